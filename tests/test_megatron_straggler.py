"""nvrx_megatron.nvrx_straggler: Bridge's manager on the core Detector.

In one process (a world of one, clocks injected): disabled is a no-op, initialize twice is
refused, per-instance detectors, a slowed rank ends in a stop answer, bad arguments are
named. Across spawned gloo ranks, on recorded timings (harness.timeline): a slow rank is flagged
and every rank answers "stop" at the same step.
"""

import datetime
import json
import logging
import os

import pytest
import torch.distributed as dist
from harness.clock import FakeClock
from harness.ranks import run_spawned_ranks
from harness.timeline import all_arrive

from nvrx_core.config import ConfigError
from nvrx_core.durable import atomic_write_json
from nvrx_megatron.config import NVRxStragglerDetectionConfig
from nvrx_megatron.nvrx_straggler import (
    NVRxStragglerDetectionManager,
    check_nvrx_straggler_detection,
    safe_shutdown_nvrx_straggler_manager,
)


def _config(**fields):
    values = dict(enabled=True, report_time_interval=1.0, num_gpu_perf_scores_to_print=0)
    values.update(fields)
    return NVRxStragglerDetectionConfig(**values)


def _run(manager, clock, steps, step_s):
    """`steps` wrapped train steps of `step_s` (injected clock); the check after each."""
    clock.step_s = step_s
    # A second wrap returns the first wrapper, so the step reads its duration from the clock.
    train_step = manager.wrap_train_step_function(lambda: setattr(clock, "now", clock.now + clock.step_s))
    answers = []
    for _ in range(steps):
        train_step()
        answers.append(check_nvrx_straggler_detection(manager))
    return answers


def test_disabled_every_call_is_a_no_op():
    manager = NVRxStragglerDetectionManager(NVRxStragglerDetectionConfig(enabled=False))
    manager.initialize()
    manager.initialize()  # disabled: nothing was initialized, so a second call is fine (Bridge)
    assert not manager.initialized and manager.detector is None

    def step():
        return 7

    assert manager.wrap_train_step_function(step) is step
    assert manager.check_stragglers(0) is False
    assert check_nvrx_straggler_detection(manager) is False
    with manager.section("anything"):
        pass
    manager.shutdown()
    safe_shutdown_nvrx_straggler_manager(manager)


def test_initialize_twice_is_refused_and_shutdown_allows_again():
    manager = NVRxStragglerDetectionManager(_config())
    manager.initialize()
    with pytest.raises(RuntimeError, match="already initialized"):
        manager.initialize()
    manager.shutdown()
    assert not manager.initialized and manager.detector is None and manager.wrapped_function is None
    manager.initialize()
    assert manager.initialized
    manager.shutdown()


def test_each_manager_has_its_own_detector():
    first, second = NVRxStragglerDetectionManager(_config()), NVRxStragglerDetectionManager(_config())
    first.initialize()
    second.initialize()  # no class-level singleton to collide with
    assert first.detector is not second.detector
    first.shutdown()
    assert second.initialized and second.detector is not None
    second.shutdown()


def test_slowed_rank_makes_check_answer_stop():
    clock = FakeClock()
    config = _config(stop_if_detected=True)
    manager = NVRxStragglerDetectionManager(config, clock=clock, timer=clock, warmup_reports=0)
    manager.initialize()
    assert not any(_run(manager, clock, 300, 0.010))  # 3 reports at 10 ms: the baseline
    answers = _run(manager, clock, 300, 0.020)  # twice as slow: individual score 0.5 < 0.7
    assert any(answers)
    first = answers.index(True)
    assert manager.last_report.stop and manager.last_report.flagged_ranks == (0,)
    assert first > 75  # the second bad report (~100 steps, the core's hysteresis), not the first (~50)
    manager.shutdown()


def test_consecutive_reports_override_gives_bridges_one_report_reaction():
    clock = FakeClock()
    manager = NVRxStragglerDetectionManager(_config(stop_if_detected=True), clock=clock, timer=clock,
                                            warmup_reports=0, consecutive_reports=1)
    manager.initialize()
    _run(manager, clock, 300, 0.010)
    answers = _run(manager, clock, 300, 0.020)
    assert answers.index(True) < 75  # the first bad report (~50 steps)
    manager.shutdown()


def test_flagged_without_stop_if_detected_answers_false():
    clock = FakeClock()
    manager = NVRxStragglerDetectionManager(_config(), clock=clock, timer=clock, warmup_reports=0)
    manager.initialize()
    _run(manager, clock, 300, 0.010)
    assert not any(_run(manager, clock, 300, 0.020))
    assert manager.last_report.flagged_ranks == (0,)  # reported, not stopped
    manager.shutdown()


def test_wrap_twice_returns_the_first_wrapper():
    manager = NVRxStragglerDetectionManager(_config())
    manager.initialize()
    wrapped = manager.wrap_train_step_function(lambda x: x + 1)
    assert wrapped(1) == 2
    assert manager.wrap_train_step_function(lambda x: x) is wrapped
    manager.shutdown()


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="expected an object with NVRxStragglerDetectionConfig's fields"):
        NVRxStragglerDetectionManager(object())
    with pytest.raises(ConfigError, match="consecutive_reports"):
        NVRxStragglerDetectionManager(_config(), consecutive_reports=0)
    manager = NVRxStragglerDetectionManager(_config())
    manager.initialize()
    with pytest.raises(TypeError, match="train_step_func"):
        manager.wrap_train_step_function(None)
    with pytest.raises(ValueError, match="global_rank"):
        manager.check_stragglers(-1)
    with pytest.raises(TypeError, match="nvrx_straggler_manager"):
        check_nvrx_straggler_detection(object())
    manager.shutdown()


def test_config_changed_after_construction_is_checked_at_initialize():
    config = _config()
    manager = NVRxStragglerDetectionManager(config)
    config.report_time_interval = -1
    with pytest.raises(ConfigError, match="report_time_interval"):
        manager.initialize()
    assert not manager.initialized


def test_safe_shutdown_logs_instead_of_raising(caplog):
    class Broken:
        def shutdown(self):
            raise OSError("disk gone")

    with caplog.at_level(logging.ERROR, logger="custom"):
        safe_shutdown_nvrx_straggler_manager(Broken(), logger_name="custom")
    assert [r for r in caplog.records if r.name == "custom"]
    safe_shutdown_nvrx_straggler_manager(None)


# ---------------------------------------------------------------- real gloo ranks

SLOW_RANK = 1


def _rank_main(rank, world, port, out_dir):
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        config = NVRxStragglerDetectionConfig(enabled=True, report_time_interval=0.5, stop_if_detected=True,
                                              gpu_relative_perf_threshold=0.8, num_gpu_perf_scores_to_print=0)
        clock = FakeClock()  # recorded timings (harness.timeline): the ranking never reads the host's clock
        manager = NVRxStragglerDetectionManager(config, clock=clock, timer=clock)
        manager.initialize()
        step_s = 0.030 if rank == SLOW_RANK else 0.015  # the slow rank takes twice as long

        def train_step():
            clock.advance(step_s)
            with manager.section("grad_sync", kind="wait"):
                all_arrive(clock)  # the fast ranks wait here for the slow one, as in data parallel

        train_step = manager.wrap_train_step_function(train_step)
        stopped_at = None
        for step in range(400):
            train_step()
            if check_nvrx_straggler_detection(manager):
                stopped_at = step
                break
        report = manager.last_report
        safe_shutdown_nvrx_straggler_manager(manager)
        atomic_write_json(os.path.join(out_dir, f"rank{rank}.json"),
                          {"stopped_at": stopped_at, "flagged": list(report.flagged_ranks) if report else None})
    finally:
        dist.destroy_process_group()


def test_slow_rank_flagged_and_every_rank_stops_at_the_same_step(tmp_path):
    world = 3
    run_spawned_ranks(_rank_main, world, str(tmp_path))

    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world)]
    stops = {r["stopped_at"] for r in results}
    assert len(stops) == 1 and None not in stops  # agreed: the same step on every rank
    assert all(r["flagged"] == [SLOW_RANK] for r in results)
