"""A process killed (SIGKILL) in the middle of a background save leaves the previous
checkpoint loadable and nothing half-written under a committed name."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from nvrx_core.checkpoint import AsyncCheckpointer, CheckpointConfig
from nvrx_core.checkpoint.direct_io import DataFile

HERE = os.path.abspath(__file__)
TENSORS, ELEMENTS = 64, 2 << 20          # 64 x 8 MiB = 512 MiB for the save that is killed


def first_state() -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32), "step": 1}


def stall_data_writes_after(nbytes: int) -> None:
    """From now on a data file's writer that has written `nbytes` stops there (a disk that
    stopped answering): the save in flight cannot finish before the test's SIGKILL, however
    late that comes (before: a fast writer could commit step 2 first; the test was void)."""
    real = DataFile.write
    stalled = threading.Event()          # never set: the test kills the process

    def write(self, view):
        real(self, view)
        if self.size >= nbytes:
            stalled.wait(600)

    DataFile.write = write


def child(root: str) -> None:
    """Commit step 1, start a big save of step 2 that stalls after 8 MiB, then wait to be killed."""
    config = CheckpointConfig(writer_threads=1, chunk_bytes=1 << 20)
    ckpt = AsyncCheckpointer(root, config, process_group=None)
    ckpt.save(first_state(), 1)
    ckpt.finalize(blocking=True)
    stall_data_writes_after(8 << 20)
    ckpt.save({f"t{i}": torch.full((ELEMENTS,), float(i)) for i in range(TENSORS)}, 2)
    print("SAVING", flush=True)
    time.sleep(600)


def partial_data_bytes(root: str) -> int:
    total = 0
    for name in os.listdir(root):
        if name.startswith(".partial-step_0000000002"):
            directory = os.path.join(root, name)
            for f in os.listdir(directory):
                if ".data" in f:
                    total += os.path.getsize(os.path.join(directory, f))
    return total


@pytest.mark.timeout(120)
def test_sigkill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    root = str(tmp_path / "ckpt")
    log = open(tmp_path / "child.log", "w+")
    proc = subprocess.Popen([sys.executable, HERE, root], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        written = 0
        while time.monotonic() < deadline and proc.poll() is None:
            log.seek(0)
            if "SAVING" in log.read():
                written = partial_data_bytes(root)
                if written > 0:
                    break
            time.sleep(0.002)
        assert written > 0, "the child never started writing step 2:\n" + log.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    names = os.listdir(root)
    # killed mid-write: step 2 exists only as a partial directory, never under its final name
    assert "step_0000000002" not in names, "the save finished before the kill; test is void"
    assert any(n.startswith(".partial-step_0000000002") for n in names)
    assert 0 < partial_data_bytes(root) < TENSORS * ELEMENTS * 4

    restarted = AsyncCheckpointer(root, process_group=None)   # a new incarnation of the job
    step, state = restarted.load_latest()
    assert step == 1
    assert torch.equal(state["w"], first_state()["w"]) and state["step"] == 1
    assert sorted(os.listdir(root)) == ["step_0000000001"]      # crashed save's leftovers gone


if __name__ == "__main__":
    child(sys.argv[1])
