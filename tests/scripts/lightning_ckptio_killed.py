"""Child of test_lightning_checkpoint_io's kill test: a real Lightning fit commits
last.ckpt at step 2; a resumed fit saves again at step 4, and there the disk stalls: the
fsync of the new last.ckpt's data file never returns (the bytes are written, not yet
durable or published). The test SIGKILLs this process while it waits there.

    python lightning_ckptio_killed.py CKPT_DIR EXPECTED_FILE MARKER_FILE
"""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from lightning_ckptio_model import TinyModel, make_trainer, weights  # noqa: E402
from nvrx_lightning.checkpoint_io import NVRxAsyncCheckpointIO  # noqa: E402


def stall_data_fsync(fragment: str, marker: str) -> None:
    """From now on the fsync of a data file under a hidden directory named with
    `fragment` blocks forever, after writing `marker` (a disk that stopped answering)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if fragment in name and ".data" in os.path.basename(name):
            with open(marker, "w") as f:
                f.write(name)
            threading.Event().wait()
        real(fd)

    os.fsync = fsync


def main(dirpath: str, expected: str, marker: str) -> None:
    io = NVRxAsyncCheckpointIO()
    model = TinyModel()
    make_trainer(dirpath, max_steps=2, io=io).fit(model)
    torch.save(weights(model), expected)
    stall_data_fsync(".last.ckpt.nvrx-partial-", marker)
    make_trainer(dirpath, max_steps=4, io=io).fit(TinyModel(), ckpt_path="last")
    print("the stalled save returned; the test expected a kill first", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
