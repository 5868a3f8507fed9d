"""The local Slurm cluster of tools/local_slurm.sh, for tests that submit real jobs to it.

`cluster_env()` brings the cluster up once (idempotent) and skips the calling test only
where the packages cannot be installed here; `exclusive()` holds the cluster for one test
module at a time (pytest-xdist runs modules side by side, and a crashed node or a fixed
rendezvous port is the whole cluster's). `wait_for_job` follows a job to its end, requeues
included, and `JobRecord` is what Slurm says of it. `reference_weights` is the fault-free
run every case is compared with: the same trainer on 4 ranks under a local ft_launcher (the
weights depend on the world size, not on how the ranks are spread over nodes).

Slurm holds a requeued batch job for about two minutes (`Reason=BeginTime`) before it may
start again; a test cannot afford that for each requeue, so `wait_for_job` releases such a
job at once (`scontrol update StartTime=now`) and counts the requeues it saw. Nothing
else of the scheduler's behaviour is changed.
"""

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import signal
import subprocess
import time
from typing import Callable, Dict, List, Optional

import pytest

from harness.launcher import REPO, run_launcher
from nvrx_core.durable import atomic_write_json

SCRIPT = os.path.join(REPO, "tools", "local_slurm.sh")
SLURM_DIR = os.environ.get("NVRX_SLURM_DIR", "/var/tmp/nvrx-slurm")
CONF = os.path.join(SLURM_DIR, "slurm.conf")
UNINSTALLABLE = ("only root can install", "no apt-get")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}

RELEASE_AFTER = 5.0
"""Seconds a requeued job stays held before wait_for_job releases it (Slurm's own hold: ~121 s)."""

_UP: List[Dict[str, str]] = []


def cluster_env() -> Dict[str, str]:
    """The environment (SLURM_CONF) that reaches the cluster, brought up on first use."""
    if not _UP:
        os.makedirs(SLURM_DIR, exist_ok=True)
        with open(os.path.join(SLURM_DIR, "up.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)        # two test processes at once: one brings it up
            out = subprocess.run(["bash", SCRIPT, "up"], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            if any(reason in out.stderr for reason in UNINSTALLABLE):
                pytest.skip(f"no Slurm here and it cannot be installed: {out.stderr.strip()}")
            raise RuntimeError(f"tools/local_slurm.sh up failed:\n{out.stdout}\n{out.stderr}")
        _UP.append({"SLURM_CONF": CONF})
    return dict(_UP[0])


@contextlib.contextmanager
def exclusive():
    """The cluster for this holder alone (an flock, released when the holder's process dies too)."""
    os.makedirs(SLURM_DIR, exist_ok=True)
    with open(os.path.join(SLURM_DIR, "tests.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


TRAINER = os.path.join(REPO, "examples", "megatron_style", "pretrain_gpt.py")


def reference_weights(shared_dir, iters: int) -> str:
    """The weights of a fault-free 4-rank run of the trainer (`iters` steps), computed once per
    test session (PYTEST_XDIST_TESTRUNUID) in `shared_dir` and shared under a lock."""
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    result = os.path.join(shared_dir, f"slurm_reference-{session}-{iters}.json")
    with open(result + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(result):
            root = os.path.join(shared_dir, f"slurm_reference-{session}-{iters}")
            out = run_launcher(["--nproc-per-node", "4", TRAINER, "--save", os.path.join(root, "ckpt"),
                                "--train-iters", str(iters), "--result-dir", root], timeout=300)
            assert out.returncode == 0, out.stdout[-4000:]
            weights = {json.load(open(os.path.join(root, f"result{r}.json")))["weights"] for r in range(4)}
            assert len(weights) == 1, weights
            atomic_write_json(result, {"weights": weights.pop()})
        with open(result) as f:
            return json.load(f)["weights"]


def slurm(*args: str, check: bool = True) -> str:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=60, env=dict(os.environ, SLURM_CONF=CONF))
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


@dataclasses.dataclass
class JobRecord:
    job_id: str
    state: str
    reason: str
    restarts: int
    exit_code: str
    nodes: str
    requeues_released: int = 0


def job_record(job_id: str) -> Optional[JobRecord]:
    """What `scontrol show job` says now; None once Slurm forgot the job."""
    out = slurm("scontrol", "show", "job", "-o", job_id, check=False)
    if not out.strip():
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", out))
    return JobRecord(job_id, fields.get("JobState", ""), fields.get("Reason", ""), int(fields.get("Restarts", 0)),
                     fields.get("ExitCode", ""), fields.get("NodeList", ""))


def wait_for_job(job_id: str, timeout: float = 300, while_running: Optional[Callable[[JobRecord], None]] = None
                 ) -> JobRecord:
    """Poll until the job ended for good (a final state, not requeued); release each
    requeue hold at once. `while_running(record)` is called at each poll while it runs."""
    deadline = time.monotonic() + timeout
    released = 0
    held_since = None
    while True:
        record = job_record(job_id)
        assert record is not None, f"Slurm forgot job {job_id}"
        record.requeues_released = released
        if record.state in FINAL_STATES:
            return record
        if record.state == "PENDING" and record.reason == "BeginTime" and record.restarts > released:
            held_since = held_since or time.monotonic()
            # not at once: the last run's credential is revoked when its nodes finish with it, and a
            # start within that second fails for good ("Job credential revoked", the job FAILED)
            if time.monotonic() - held_since >= RELEASE_AFTER:
                slurm("scontrol", "update", f"jobid={job_id}", "StartTime=now")
                released, held_since = record.restarts, None
        if record.state == "RUNNING" and while_running is not None:
            while_running(record)
        if time.monotonic() > deadline:
            slurm("scancel", job_id, check=False)
            raise AssertionError(f"job {job_id} still {record.state} ({record.reason}) after {timeout}s: cancelled")
        time.sleep(0.5)


def crash_node(node: str) -> List[int]:
    """The node dies as a machine does: its slurmd and every process of a job step there are
    SIGKILLed (the processes are found by the SLURMD_NODENAME their step gave them, with the
    slurmstepd above them), and Slurm is told it is DOWN, as a health check would. It stays
    down until `nodes_back()`. The pids killed."""
    pidfile = os.path.join(SLURM_DIR, f"slurmd-{node}.pid")
    with open(pidfile) as f:
        _kill(int(f.read().strip()))
    victims = set()
    for pid in _pids():
        if _environ(pid).get("SLURMD_NODENAME") == node:
            victims.add(pid)
            parent = _parent(pid)
            if parent and _comm(parent).startswith("slurmstepd"):
                victims.add(parent)
    for pid in sorted(victims, key=lambda p: not _comm(p).startswith("slurmstepd")):
        _kill(pid)
    slurm("scontrol", "update", f"nodename={node}", "state=down", "reason=nvrx-test-crash")
    return sorted(victims)


def _pids() -> List[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _environ(pid: int) -> Dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def nodes_back() -> None:
    """Every node that a test crashed is started and resumed; returns once all are idle again."""
    subprocess.run(["bash", SCRIPT, "up"], capture_output=True, text=True, timeout=600, check=True)
