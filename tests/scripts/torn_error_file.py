"""A worker killed while it writes its error record: in cycle 0, rank 1 creates the error file
torch's spawn wrapper gave it (empty, as `open(path, "wb")` leaves it before the pickle is
written) and is SIGKILLed; rank 0 waits to be stopped. Cycle 1 appends "RANK:CYCLE" to the
file named by the first argument and finishes. Warm start only: cold-started workers have no
such file. The file's path is found in torch's spawn wrapper's frame (`_wrap`'s `error_file`),
a torch internal this test script alone relies on; it fails naming that if torch changes."""
import os
import signal
import sys
import time


def spawn_error_file() -> str:
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "_wrap" and "error_file" in frame.f_locals:
            return frame.f_locals["error_file"]
        frame = frame.f_back
    raise RuntimeError("not a worker started through torch.multiprocessing's spawn wrapper")


marker, rank, cycle = sys.argv[1], int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if cycle == 0:
    if rank == 1:
        open(spawn_error_file(), "wb").close()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # stopped by the launcher once rank 1 is gone
with open(marker, "a") as f:
    f.write(f"{rank}:{cycle}\n")
