"""NVRxStragglerDetection in real Lightning fits on CPU.

A two-rank DDP job under ft_launcher (tests/scripts/lightning_straggler_job.py) where rank
1's forward takes twice as long, on recorded timings (the detector's clock and timer a
FakeClock the forward advances: the ranking never reads the host's clock, so its score is
exactly 1/2): rank 1 is named by the second report, rank 0 logs the scores through the Trainer's loggers, and with stop_if_detected
every rank saves the checkpoint and exits 19, as does the launcher. Single-process tests
run the Trainer in this process (devices=1, no torch.distributed).
"""

import inspect
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

from harness.launcher import SCRIPTS, kinds, run_launcher
from nvrx_core.config import ConfigError
from nvrx_core.events import STRAGGLER_FOUND, read_events
from nvrx_core.exit_codes import ExitCode

sys.path.insert(0, SCRIPTS)
import lightning_straggler_job as job  # noqa: E402  (imports Lightning)

from nvrx_lightning.straggler import NVRxStragglerDetection  # noqa: E402

JOB = os.path.join(SCRIPTS, "lightning_straggler_job.py")
STOP = int(ExitCode.STRAGGLER_STOP)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def logged(out, rank):
    path = os.path.join(out, f"metrics.rank{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def score_rows(rows):
    return [r for r in rows if "gpu_relative_perf/min" in r]


@pytest.mark.timeout(240)
def test_slow_rank_named_by_the_second_report_scores_logged_then_checkpoint_and_exit_19(tmp_path):
    out, events_file = str(tmp_path), str(tmp_path / "events.jsonl")
    done = run_launcher(["--nproc-per-node", "2", "--max-restarts", "1", "--events-file", events_file,
                         "--warm-start-preload", "lightning.pytorch,nvrx_lightning", JOB, "--out", out, "--slow-rank", "1", "--slow-factor", "2.0", "--threshold", "0.8",
                         "--report-time-interval", "0.5", "--stop-if-detected"], timeout=200)
    assert done.returncode == STOP, done.stdout[-4000:]
    results = [read_json(os.path.join(out, f"result.rank{r}.json")) for r in range(2)]
    step = results[0]["global_step"]
    for r in results:
        assert r["exit"] == STOP and r["global_step"] == step   # every rank, at the same step
        assert r["flagged"] == [1] and r["last_report"] <= 2, results
        assert r["unwrapped"], "training_step still wrapped after the stop"
    saved = os.path.join(out, "ckpt", f"last-straggler-stop-step={step}.ckpt")
    assert torch.load(saved, map_location="cpu", weights_only=False)["global_step"] == step
    found = kinds(read_events(events_file), STRAGGLER_FOUND)
    assert found and {e["straggler_rank"] for e in found} == {1}
    assert all(e["action"] == "stop" and e["report_index"] <= 2 for e in found)
    # Reports before the stopping one reach the Trainer's loggers, on rank 0 only. Lightning
    # hands a value a callback logged to the loggers again at every later step of the epoch.
    rows = score_rows(logged(out, 0))
    assert rows and not score_rows(logged(out, 1))
    assert len({row["gpu_relative_perf/min"] for row in rows}) == results[0]["last_report"] - 1
    for row in rows:
        assert row["gpu_relative_perf/min"] == pytest.approx(0.5), row                # rank 1: 1/2
        assert row["gpu_relative_perf/max"] == pytest.approx(1.0), row                 # rank 0


@pytest.mark.timeout(120)
def test_one_process_fit_twice_on_one_trainer(tmp_path):
    assert not dist.is_initialized()
    # One rank: its relative score is 1 by definition. Its individual score (against its own
    # past) is off: 5 ms sleeps on a loaded CI node take twice that for reports in a row.
    detection = NVRxStragglerDetection(report_time_interval=0.1, num_gpu_perf_scores_to_print=0,
                                       calc_individual_gpu_perf=False)
    trainer = job.make_trainer(str(tmp_path), 1, 40, [detection])
    model = job.SleepyNet(step_s=0.005)
    for fit, max_steps in ((1, 40), (2, 80)):
        trainer.fit_loop.epoch_loop.max_steps = max_steps
        trainer.fit(model)
        assert trainer.global_step == max_steps
        assert "training_step" not in vars(trainer.strategy), f"fit {fit} left training_step wrapped"
        assert detection.report_count >= 1 and detection.last_report.complete
        assert detection.last_report.index == detection.report_count   # counted from 1 in each fit
        assert detection.last_report.flagged_ranks == ()
    rows = score_rows(logged(str(tmp_path), 0))
    assert len(rows) >= 2 and all(r["gpu_relative_perf/median"] == 1.0 for r in rows)


def test_defaults_are_megatron_bridges_and_names_the_peers():
    bridge = dict(report_time_interval=300.0, calc_relative_gpu_perf=True, calc_individual_gpu_perf=True,
                  num_gpu_perf_scores_to_print=5, gpu_relative_perf_threshold=0.7,
                  gpu_individual_perf_threshold=0.7, stop_if_detected=False, enable_ptl_logging=True,
                  profiling_interval=1, logger_name="megatron.bridge.NVRxStragglerDetection")
    parameters = inspect.signature(NVRxStragglerDetection).parameters
    assert list(parameters)[:len(bridge)] == list(bridge)          # the peer's order: positional use ports
    assert {name: parameters[name].default for name in bridge} == bridge
    config = NVRxStragglerDetection().config
    assert (config.report_time_interval, config.relative_perf_threshold, config.num_scores_to_print) == (300.0, 0.7, 5)


@pytest.mark.parametrize("kwargs,match", [
    ({"gpu_relative_perf_threshold": 1.5}, r"^gpu_relative_perf_threshold=1.5: must be a score in \(0, 1\]"),
    ({"gpu_individual_perf_threshold": 0}, r"^gpu_individual_perf_threshold=0: must be a score"),
    ({"report_time_interval": 0}, r"^report_time_interval=0: must be a number of seconds > 0"),
    ({"calc_relative_gpu_perf": False, "calc_individual_gpu_perf": False},
     r"^calc_relative_gpu_perf=False: at least one of calc_relative_gpu_perf / calc_individual_gpu_perf"),
    ({"num_gpu_perf_scores_to_print": -1}, r"^num_gpu_perf_scores_to_print=-1: must be an integer >= 0"),
    ({"stop_if_detected": "yes"}, r"^stop_if_detected='yes': must be true or false"),
    ({"enable_ptl_logging": 1}, r"^enable_ptl_logging=1: must be True or False"),
    ({"profiling_interval": 0}, r"^profiling_interval=0: must be an integer >= 1"),
    ({"dirpath": 3}, r"^dirpath=3: must be a directory path or None"),
    ({"consecutive_reports": 0}, r"^consecutive_reports=0: must be an integer >= 1"),
    ({"relative_perf_threshold": 0.5}, r"^relative_perf_threshold: set it with this callback's argument "
                                        r"'gpu_relative_perf_threshold'"),
    ({"no_such_field": 1}, r"^NVRxStragglerDetection: unknown field 'no_such_field'"),
])
def test_bad_arguments_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        NVRxStragglerDetection(**kwargs)
