"""The TCPStore a test holds for its ranks: in the test process, or in a process of its own.

`host_store` serves from the test process on a free port (ranks connect to `.port`).
`store_process` serves from a child process, so a test can stall the store (`stop`: SIGSTOP,
then wait until the kernel says it is stopped) and see what the ranks do without it.
"""

import contextlib
import os
import signal
import subprocess
import sys
from typing import Iterator, Optional, Tuple

import torch.distributed as dist

from harness.waiting import wait_for

_STORE_HOST = """
import sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()  # until the test closes stdin (or kills this process)
"""


def host_store(world_size: Optional[int] = None, **kwargs) -> dist.TCPStore:
    """A TCPStore served by the test process on a free port; it does not wait for the workers, so
    a rank that never comes cannot hang the test. kwargs go to TCPStore (multi_tenant=True, ...)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, **kwargs)


@contextlib.contextmanager
def store_process() -> Iterator[Tuple[subprocess.Popen, int]]:
    """(the store's process, its port); the process is continued and killed at exit."""
    proc = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        yield proc, int(proc.stdout.readline())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def stop(pid: int) -> None:
    """SIGSTOP takes effect some time after kill() returns: wait until the process is stopped."""
    os.kill(pid, signal.SIGSTOP)

    def stopped():
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and line.split()[1] in ("T", "t") for line in f)

    wait_for(stopped, timeout=20, what=f"process {pid} to stop")
