"""NVRxStragglerDetection in real Hugging Face Trainer runs on CPU.

A two-rank gloo job under ft_launcher (tests/scripts/hf_straggler_job.py) where rank 1's
forward takes twice as long, on recorded timings (the detector's clock and timer a FakeClock
the forward advances: the ranking never reads the host's clock, so its score is exactly 1/2):
rank 1 is named by the second report, rank 0's log history carries every
report's scores, and with stop_if_detected the Trainer saves checkpoint-<step> with every
rank's share, every rank exits 19 at that step, and so does the launcher. The single-process
test runs the Trainer in this process (no torch.distributed).
"""

import inspect
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports transformers: nothing is fetched

import pytest
import torch.distributed as dist

from harness.launcher import SCRIPTS, kinds, run_launcher
from nvrx_core.config import ConfigError
from nvrx_core.events import STRAGGLER_FOUND, read_events
from nvrx_core.exit_codes import ExitCode

sys.path.insert(0, SCRIPTS)
import hf_tiny  # noqa: E402  (imports transformers)

from nvrx_hf import NVRxStragglerDetection  # noqa: E402
from transformers import Trainer  # noqa: E402

JOB = os.path.join(SCRIPTS, "hf_straggler_job.py")
STOP = int(ExitCode.STRAGGLER_STOP)


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def score_rows(log_history):
    return [row for row in log_history if "gpu_relative_perf/min" in row]


@pytest.mark.timeout(300)
def test_slow_rank_named_by_the_second_report_then_checkpoint_and_exit_19_on_every_rank(tmp_path):
    out, events_file = str(tmp_path), str(tmp_path / "events.jsonl")
    done = run_launcher(["--nproc-per-node", "2", "--max-restarts", "1", "--events-file", events_file,
                         "--warm-start-preload", "transformers.trainer,nvrx_hf", JOB, "--out", out,
                         "--slow-rank", "1", "--slow-factor", "2.0", "--threshold", "0.8",
                         "--report-time-interval", "0.5", "--stop-if-detected"],
                        timeout=240, env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == STOP, done.stdout[-4000:]
    # Written by each rank in its on_save, before the barrier that precedes any exit.
    saved = [read_json(os.path.join(out, f"saved.rank{r}.json")) for r in range(2)]
    step = saved[0]["step"]
    assert [s["step"] for s in saved] == [step, step], saved             # every rank, at the same step
    assert [s["flagged"] for s in saved] == [[1], [1]] and saved[0]["report"] <= 2, saved
    checkpoint = os.path.join(out, f"checkpoint-{step}")
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "trainer_state.json"} <= set(os.listdir(checkpoint))
    state = read_json(os.path.join(checkpoint, "trainer_state.json"))
    assert state["global_step"] == step
    found = kinds(read_events(events_file), STRAGGLER_FOUND)
    assert found and {e["straggler_rank"] for e in found} == {1}
    assert all(e["action"] == "stop" and e["report_index"] <= 2 for e in found)
    # Every report reaches rank 0's log history, the stopping one too: with logging_steps=1 the
    # Trainer logs the stop's step before it saves, and the checkpoint keeps the history.
    rows = score_rows(state["log_history"])
    assert len(rows) == saved[0]["report"], state["log_history"][-3:]
    for row in rows:
        assert row["gpu_relative_perf/min"] == pytest.approx(0.5), row      # rank 1: 1/2
        assert row["gpu_relative_perf/max"] == pytest.approx(1.0), row      # rank 0
    # The first rank to exit ends the cycle and the agent stops the other, which may be killed
    # before its result is written; a result that exists says 19 and an unwrapped forward.
    results = [r for r in (read_json(os.path.join(out, f"result.rank{r}.json")) for r in range(2)) if r]
    assert results and all(r["exit"] == STOP and r["global_step"] == step and r["unwrapped"] for r in results), results


@pytest.mark.timeout(180)
def test_one_process_train_twice_times_forward_logs_scores_and_unwraps(tmp_path):
    assert not dist.is_initialized()
    # One rank: its relative score is 1 by definition; its individual score (against its own
    # past) is off, as a loaded CI node blurs a rank's pace from one report to the next.
    detection = NVRxStragglerDetection(report_time_interval=0.2, num_gpu_perf_scores_to_print=0,
                                       calc_individual_gpu_perf=False)
    model = hf_tiny.tiny_model()
    trainer = Trainer(model=model, args=hf_tiny.training_args(str(tmp_path), 30, logging_steps=1),
                      train_dataset=hf_tiny.Tokens(512), callbacks=[detection])
    model.transformer.register_forward_pre_hook(lambda module, inputs: time.sleep(0.02))
    for attempt, max_steps in ((1, 30), (2, 60)):
        trainer.args.max_steps = max_steps
        trainer.train(resume_from_checkpoint=attempt > 1)
        assert trainer.state.global_step == max_steps
        assert "forward" not in vars(model), f"train {attempt} left forward wrapped"
        assert detection.report_count >= 1 and detection.last_report.complete
        assert detection.last_report.index == detection.report_count   # counted from 1 in each train()
        assert detection.last_report.flagged_ranks == () and detection.stopped_at_step is None
        assert detection.last_report.ranks[0].section_ms["forward"] >= 20.0   # the sleep is inside the timed forward
    rows = score_rows(trainer.state.log_history)
    assert len(rows) >= 2 and all(r["gpu_relative_perf/median"] == 1.0 for r in rows)


def test_defaults_are_megatron_bridges_and_names_the_peers():
    bridge = dict(report_time_interval=300.0, calc_relative_gpu_perf=True, calc_individual_gpu_perf=True,
                  num_gpu_perf_scores_to_print=5, gpu_relative_perf_threshold=0.7,
                  gpu_individual_perf_threshold=0.7, stop_if_detected=False, profiling_interval=1)
    parameters = inspect.signature(NVRxStragglerDetection).parameters
    assert list(parameters)[:len(bridge) + 1] == [*bridge, "logger_name"]
    assert {name: parameters[name].default for name in bridge} == bridge
    config = NVRxStragglerDetection().config
    assert (config.report_time_interval, config.relative_perf_threshold, config.num_scores_to_print) == (300.0, 0.7, 5)
    assert config.logger_name == "nvrx.hf.straggler"


@pytest.mark.parametrize("kwargs,match", [
    ({"gpu_relative_perf_threshold": 1.5}, r"^gpu_relative_perf_threshold=1.5: must be a score in \(0, 1\]"),
    ({"gpu_individual_perf_threshold": 0}, r"^gpu_individual_perf_threshold=0: must be a score"),
    ({"report_time_interval": 0}, r"^report_time_interval=0: must be a number of seconds > 0"),
    ({"calc_relative_gpu_perf": False, "calc_individual_gpu_perf": False},
     r"^calc_relative_gpu_perf=False: at least one of calc_relative_gpu_perf / calc_individual_gpu_perf"),
    ({"num_gpu_perf_scores_to_print": -1}, r"^num_gpu_perf_scores_to_print=-1: must be an integer >= 0"),
    ({"stop_if_detected": "yes"}, r"^stop_if_detected='yes': must be true or false"),
    ({"profiling_interval": 0}, r"^profiling_interval=0: must be an integer >= 1"),
    ({"log_scores": 1}, r"^log_scores=1: must be True or False"),
    ({"consecutive_reports": 0}, r"^consecutive_reports=0: must be an integer >= 1"),
    ({"relative_perf_threshold": 0.5}, r"^relative_perf_threshold: set it with this callback's argument "
                                        r"'gpu_relative_perf_threshold'"),
    ({"no_such_field": 1}, r"^NVRxStragglerDetection: unknown field 'no_such_field'"),
])
def test_bad_arguments_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        NVRxStragglerDetection(**kwargs)
