"""A Hugging Face Trainer job with NVRxStragglerDetection, for tests/test_hf_straggler.py.

Run under a launcher as a 2-rank CPU job (gloo). The model's transformer body (inside the
forward the callback times) sleeps --step-s per call, --slow-factor times longer on
--slow-rank: sleeps need no CPU, so a loaded test machine does not blur the ranks apart.

Writes into --out: saved.rank<R>.json in on_save of a straggler stop's checkpoint (listed
before the detection callback, so before the barrier no rank passes until every rank saved:
the launcher stopping the job cannot cut it short), and when train() returns or raises
SystemExit, result.rank<R>.json. Checkpoints: --out/checkpoint-<step>.
"""

import argparse
import os
import time

import torch
from transformers import Trainer, TrainerCallback

from hf_tiny import Tokens, rank_and_world, tiny_model, training_args
from nvrx_core.durable import atomic_write_json
from nvrx_hf import NVRxStragglerDetection


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
    model.transformer.register_forward_pre_hook(lambda module, inputs: time.sleep(pause))
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
