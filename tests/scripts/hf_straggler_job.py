"""A Hugging Face Trainer job with NVRxStragglerDetection, for tests/test_hf_straggler.py.

Run under a launcher as a 2-rank CPU job (gloo). The model's transformer body (inside the
forward the callback times) takes --step-s per call, --slow-factor times longer on
--slow-rank, on recorded timings: the detector's clock and timer are a FakeClock
(tests/harness) that the body advances by that much, so which rank is slow, and its score,
are decided by the durations given, never by how late a loaded host woke a sleeping rank.
The Trainer, the ranks and their collectives are real.

Writes into --out: saved.rank<R>.json in on_save of a straggler stop's checkpoint (listed
before the detection callback, so before the barrier no rank passes until every rank saved:
the launcher stopping the job cannot cut it short), and when train() returns or raises
SystemExit, result.rank<R>.json. Checkpoints: --out/checkpoint-<step>.
"""

import argparse
import functools
import os
import sys

import torch
from transformers import Trainer, TrainerCallback

from hf_tiny import Tokens, rank_and_world, tiny_model, training_args
from nvrx_core.durable import atomic_write_json
from nvrx_core.straggler import Detector
from nvrx_hf import NVRxStragglerDetection
from nvrx_hf import straggler as hf_straggler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for the harness
from harness.clock import FakeClock  # noqa: E402


class SavedRecord(TrainerCallback):
    def __init__(self, out, rank, detection):
        self.path = os.path.join(out, f"saved.rank{rank}.json")
        self.detection = detection

    def on_save(self, args, state, control, **kwargs):
        report = self.detection.last_report
        if self.detection.stopped_at_step is not None:
            atomic_write_json(self.path, {"step": state.global_step, "report": report.index,
                                          "flagged": list(report.flagged_ranks)})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-factor", type=float, default=2.0)
    p.add_argument("--report-time-interval", type=float, default=0.5)
    p.add_argument("--threshold", type=float, default=0.8)
    p.add_argument("--stop-if-detected", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, _ = rank_and_world()
    model = tiny_model()
    pause = args.step_s * (args.slow_factor if rank == args.slow_rank else 1.0)
    clock = FakeClock()  # the callback's Detector reads it (it has no clock argument of its own)
    hf_straggler.Detector = functools.partial(Detector, clock=clock, timer=clock)
    model.transformer.register_forward_pre_hook(lambda module, inputs: clock.advance(pause))
    detection = NVRxStragglerDetection(
        report_time_interval=args.report_time_interval, num_gpu_perf_scores_to_print=0,
        gpu_relative_perf_threshold=args.threshold, gpu_individual_perf_threshold=args.threshold,
        stop_if_detected=args.stop_if_detected,
    )
    trainer = Trainer(model=model, args=training_args(args.out, args.max_steps, logging_steps=1),
                      train_dataset=Tokens(), callbacks=[SavedRecord(args.out, rank, detection), detection])
    result = {"rank": rank}
    try:
        trainer.train()
        result["exit"] = 0
    except SystemExit as e:
        result["exit"] = e.code
        raise
    finally:
        report = detection.last_report
        result.update(
            global_step=trainer.state.global_step, reports=detection.report_count,
            last_report=None if report is None else report.index,
            flagged=None if report is None else list(report.flagged_ranks),
            unwrapped="forward" not in vars(model),
        )
        atomic_write_json(os.path.join(args.out, f"result.rank{rank}.json"), result)


if __name__ == "__main__":
    main()
