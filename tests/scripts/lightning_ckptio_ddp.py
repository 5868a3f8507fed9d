"""Two ranks (DDP, gloo, CPU) fit with NVRxAsyncCheckpointIO, then fit a fresh model on
the same Trainer from ckpt_path="last". Each rank writes what its IO was asked to do and
where the second fit started to OUT_DIR/rank<r>.json.

    python lightning_ckptio_ddp.py CKPT_DIR OUT_DIR
(Lightning's DDP launcher starts rank 1 by running this script again.)
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lightning_ckptio_model import TinyModel, make_trainer, weights  # noqa: E402
from nvrx_lightning.checkpoint_io import NVRxAsyncCheckpointIO  # noqa: E402


class CountingIO(NVRxAsyncCheckpointIO):
    """Counts the calls Lightning's strategy makes on this rank."""

    def __init__(self):
        super().__init__()
        self.calls = {"save": 0, "load": 0, "remove": 0, "started": 0}

    def save_checkpoint(self, *args, **kwargs):
        self.calls["save"] += 1
        super().save_checkpoint(*args, **kwargs)
        self.calls["started"] += self._checkpointer is not None

    def load_checkpoint(self, *args, **kwargs):
        self.calls["load"] += 1
        return super().load_checkpoint(*args, **kwargs)

    def remove_checkpoint(self, *args, **kwargs):
        self.calls["remove"] += 1
        super().remove_checkpoint(*args, **kwargs)


def flat(state: dict) -> list:
    return [x for key in sorted(state) for x in state[key].flatten().tolist()]


def main(dirpath: str, out_dir: str) -> None:
    io = CountingIO()
    trainer = make_trainer(dirpath, max_steps=4, io=io, strategy="ddp", devices=2)
    first = TinyModel()
    trainer.fit(first)
    end_of_first = weights(first)
    trainer.fit_loop.epoch_loop.max_steps = 8
    second = TinyModel()
    trainer.fit(second, ckpt_path="last")
    result = {"rank": trainer.global_rank, "calls": io.calls, "start_step": second.start_step,
              "end_of_first": flat(end_of_first), "start_of_second": flat(second.start_weights),
              "writer_after_teardown": io._checkpointer is not None}
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
