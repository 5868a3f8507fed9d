"""Several launcher agents on this machine, each its own "node": rehearse losing one.

A node here is one launcher process (ft_launcher, or torchrun for comparison) with its
workers; losing it means SIGKILL (or SIGSTOP, a hung node) to its whole process tree,
workers included, as when a machine dies. Every node gets its own log and events file
($NVRX_EVENTS_FILE reaches the workers under either launcher). The first node started
hosts the rendezvous store; it is started alone and waited for, so a test knows which
node not to lose. Used by tests/test_multinode.py and bench/multinode.py.
"""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence

from nvrx_core.events import EVENTS_FILE_ENV, read_events
from nvrx_core.ft.process_groups import descendants

FT_LAUNCHER = (sys.executable, "-m", "nvrx_core.ft.command")
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")


@dataclasses.dataclass
class Node:
    name: str
    proc: Any
    """A subprocess.Popen, or what the cluster's `popen` returned in its place."""
    events_file: str
    log_file: str

    def tree(self) -> List[int]:
        return [self.proc.pid, *sorted(descendants(self.proc.pid))]

    def kill(self) -> None:
        self._signal_tree(signal.SIGKILL)

    def stop(self) -> None:
        """A hung machine: every process of the node stops where it is."""
        self._signal_tree(signal.SIGSTOP)

    def _signal_tree(self, sig: int) -> None:
        for pid in self.tree():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def events(self, kind: Optional[str] = None) -> List[dict]:
        found = read_events(self.events_file) if os.path.exists(self.events_file) else []
        return [e for e in found if kind is None or e["kind"] == kind]

    def group_ranks(self) -> List[int]:
        """This node's group rank in each rendezvous it completed (ft_launcher's events)."""
        return [e["group_rank"] for e in self.events("rendezvous_done")]

    def output(self) -> str:
        with open(self.log_file, errors="replace") as f:
            return f.read()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


class LocalCluster:
    """Agents of one job (`run_id`) on 127.0.0.1, meeting at one rendezvous endpoint."""

    def __init__(self, workdir: str, job: Sequence[str], nnodes: str = "2", nproc_per_node: int = 2,
                 launcher: Sequence[str] = FT_LAUNCHER, flags: Sequence[str] = (), env: Optional[Dict] = None,
                 popen: Callable[..., Any] = subprocess.Popen):
        """`popen`: starts a node's command line (subprocess.Popen's arguments); a test suite
        may start nodes from a process that imported torch already."""
        self.workdir = workdir
        self.popen = popen
        self.job = list(job)
        self.launcher = list(launcher)
        self.port = free_port()
        self.common = ["--nnodes", nnodes, "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", uuid.uuid4().hex[:8], *flags]
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
        self.env.pop("FAULT_TOL_FINISHED_FLAG_FILE", None)
        self.nodes: List[Node] = []

    def start(self, name: str, flags: Sequence[str] = (), env: Optional[Dict] = None) -> Node:
        events_file = os.path.join(self.workdir, f"{name}.events.jsonl")
        log_file = os.path.join(self.workdir, f"{name}.log")
        is_ft = self.launcher == list(FT_LAUNCHER)
        argv = [*self.launcher, *self.common, *flags, *(["--events-file", events_file] if is_ft else []), *self.job]
        with open(log_file, "w") as log:
            proc = self.popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**self.env, EVENTS_FILE_ENV: events_file, **(env or {})})
        node = Node(name, proc, events_file, log_file)
        self.nodes.append(node)
        if len(self.nodes) == 1:
            self._wait_for_store(node)
        return node

    def _wait_for_store(self, host: Node, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if host.proc.poll() is not None:
                raise RuntimeError(f"node {host.name} exited {host.proc.returncode}:\n{host.output()[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"node {host.name} did not open the rendezvous store in {timeout} s")

    def close(self) -> None:
        """Kill whatever is left, stopped nodes included."""
        for node in self.nodes:
            node._signal_tree(signal.SIGKILL)
            try:
                node.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(poll)


def checkpoint_after(nodes: Sequence[Node], since: float) -> bool:
    """Has any node recorded a committed checkpoint after `since` (wall time)?"""
    return any(e["time"] > since for n in nodes for e in n.events("checkpoint_committed"))


def first_step_after(nodes: Sequence[Node], since: float) -> Optional[float]:
    """When training was back: the first step done after a training_resumed event, both after `since`."""
    found = [e for n in nodes for e in n.events() if e["time"] > since]
    resumed = [e["time"] for e in found if e["kind"] == "training_resumed"]
    if not resumed:
        return None
    steps = [e["time"] for e in found if e["kind"] == "step_done" and e["time"] > min(resumed)]
    return min(steps) if steps else None
