"""A node joining an elastic job late (--nnodes 1:2): both nodes' workers finish together.

Two ft_launcher agents on this machine, each its own node, share a c10d rendezvous. The
first starts alone (1 node is enough) and its workers start in a world of nproc; the
second then joins, the first re-rendezvouses, and the job must finish in a world of
2 x nproc. The two agents have counted different numbers of attempts (the first restarted
for the newcomer, the second never did), so they must agree on each round's worker store
through the rendezvous itself, not through their own counters.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from harness.launcher import SCRIPTS
from harness import wait_for

JOB = os.path.join(SCRIPTS, "late_join_job.py")
NPROC = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(name, port, out, events):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NVRX_TEST_NODE=name)
    env.pop("NVRX_EVENTS_FILE", None)
    env.pop("FAULT_TOL_FINISHED_FLAG_FILE", None)
    log = open(os.path.join(out, f"launcher.{name}.log"), "w")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "nvrx_core.ft.command", "--nnodes", "1:2", "--nproc-per-node", str(NPROC),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "late-join",
             "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "3", "--events-file", events,
             JOB, "--out", out, "--world", str(2 * NPROC)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    finally:
        log.close()


def _started(out, node, cycle):
    return all(os.path.exists(os.path.join(out, f"started.{node}.{cycle}.rank{r}")) for r in range(NPROC))


def _logs(out):
    return "".join(f"\n--- {name}\n" + open(os.path.join(out, name)).read()[-4000:]
                   for name in sorted(os.listdir(out)) if name.startswith("launcher."))


@pytest.mark.timeout(400)
def test_a_late_node_joins_and_the_job_finishes_on_both_nodes(tmp_path):
    out, port = str(tmp_path), _free_port()
    nodes = {}
    try:
        nodes["first"] = _start_node("first", port, out, str(tmp_path / "events.first.jsonl"))
        wait_for(lambda: _started(out, "first", 0), timeout=150, what="the first node's workers")
        nodes["late"] = _start_node("late", port, out, str(tmp_path / "events.late.jsonl"))
        for name, proc in nodes.items():
            try:
                proc.wait(timeout=200)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the {name} node did not finish within 200 s{_logs(out)}")
    finally:
        for proc in nodes.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its monitor, any worker left
            except ProcessLookupError:
                pass
            proc.wait()
    assert [p.returncode for p in nodes.values()] == [0, 0], _logs(out)
    done = [json.load(open(os.path.join(out, f"done.rank{r}.json"))) for r in range(2 * NPROC)]
    assert {(d["world"], d["sum"]) for d in done} == {(2 * NPROC, 2 * NPROC)}
    assert sorted(d["node"] for d in done) == ["first"] * NPROC + ["late"] * NPROC
