"""Preemption the way Slurm signals it: SIGTERM to every process of the job step at once.

`sbatch --signal=TERM@60` has slurmstepd send SIGTERM to ft_launcher, its node monitor, its
warm-start fork server, every worker and their children. A real 2-rank job
(tests/scripts/preempt_job.py) gets it that way, warm and cold started: every rank saves at
the same step and exits PREEMPTED (18), the helpers survive the signal (the monitor is not
restarted, the fork server still reports the workers' exits), and the launcher ends 18 (0
under NVRX_PREEMPTED_EXIT_CODE=0) with the preemption in its events and no failed cycle in the
report. SIGTERM to the launcher alone is forwarded to the workers, with the same result. A
script without a preemption handler is killed by the forwarded signal, and the launcher exits
143 as torchrun does. A launcher that has no worker yet (a node waiting in its rendezvous, as
a hot spare does) has nothing to save: it ends PREEMPTED too, not killed by the signal's
default action. Nothing of the job outlives the launcher.
"""

import json
import os
import signal

import pytest

import warm_python
from harness.launcher import SCRIPTS, alive, kill_tree, kinds, preempt_progress, start_ticks
from nvrx_core.demo.nodes import free_port
from nvrx_core.events import read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.ft.process_groups import descendants
from nvrx_core.report import attribution
from nvrx_core.report.incidents import find_incidents
from harness import wait_for

JOB = os.path.join(SCRIPTS, "preempt_job.py")
pytestmark = pytest.mark.timeout(300)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def run_job(tmp_path, start_args, job_args, signal_to, env=None):
    """Start ft_launcher on the job, wait until both ranks train, SIGTERM the launcher (and, for
    "step", every process below it at once: the launcher first, then the rest, as fast as a
    loop can), and return (exit code, output, events, the processes the job had)."""
    out, events_file = str(tmp_path), str(tmp_path / "events.jsonl")
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    full_env.pop("NVRX_EVENTS_FILE", None)
    full_env.pop("FAULT_TOL_FINISHED_FLAG_FILE", None)
    launcher = warm_python.popen(
        ["-m", "nvrx_core.ft.command", "--nproc-per-node", "2", "--max-restarts", "2",
         "--workers-stop-timeout", "90", "--events-file", events_file, *start_args, JOB, "--out", out, *job_args],
        stdout=warm_python.PIPE, stderr=warm_python.STDOUT, text=True, env=full_env, start_new_session=True,
        preload=warm_python.LAUNCHER)
    try:
        wait_for(lambda: all((preempt_progress(out, r) or {}).get("step", -1) >= 4 for r in (0, 1)), timeout=150,
                 what="both workers training")
        workers = {preempt_progress(out, r)["pid"] for r in (0, 1)}
        wait_for(lambda: workers <= descendants(launcher.pid), timeout=30, what="both workers in the tree")
        tree = [launcher.pid, *sorted(descendants(launcher.pid))]
        commands = {pid: (_cmdline(pid), _parent(pid)) for pid in tree}
        output = _sigterm_and_reap(launcher, tree, tree if signal_to == "step" else tree[:1], timeout=180)
    finally:
        _kill_launcher(launcher)
    return launcher.returncode, output, read_events(events_file), commands


def _sigterm_and_reap(launcher, tree, targets, timeout):
    """SIGTERM `targets` (in order), wait for the launcher's output and exit, then until every
    process of `tree` is gone (the monitor and the fork server end with the launcher)."""
    started = {pid: start_ticks(pid) for pid in tree}
    for pid in targets:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    output, _ = launcher.communicate(timeout=timeout)
    wait_for(lambda: not [p for p in tree if alive(p, started[p])], timeout=60, what="the job's processes gone")
    return output


def _kill_launcher(launcher):
    kill_tree(launcher.pid)
    if launcher.poll() is None:
        launcher.kill()
        launcher.communicate()


def _reports(out):
    return [json.load(open(os.path.join(out, f"report.rank{r}.json"))) for r in (0, 1)]


def _check_preempted(tmp_path, events, output):
    reports = _reports(str(tmp_path))
    assert reports[0]["stopped_at"] == reports[1]["stopped_at"], reports  # every rank saves at the same step
    for report in reports:
        assert report["signals"] and set(report["signals"]) == {"SIGTERM"}, reports
        assert (report["sigterm_owner"], report["cycle"]) == ("preemption", 0)
    [signaled] = kinds(events, "launcher_signaled")
    assert (signaled["signal"], signaled["preempted"]) == ("SIGTERM", True), signaled
    assert signaled["exit_codes"] == {"0": ExitCode.PREEMPTED, "1": ExitCode.PREEMPTED}, signaled
    assert sorted(signaled["running_ranks"]) == [0, 1]
    assert not kinds(events, "workers_failed") and not kinds(events, "restart_begun"), output[-4000:]
    assert not kinds(events, "monitor_restarted"), output[-4000:]  # the monitor watched the save through
    [exit_event] = kinds(events, "launcher_exit")
    assert (exit_event["exit_code"], exit_event["meaning"]) == (ExitCode.PREEMPTED, "PREEMPTED")
    assert {e["rank"] for e in kinds(events, "preemption_agreed")} == {0, 1}
    assert find_incidents(events) == []  # `nvrx report`: no failed cycle, no rank blamed
    return exit_event


@pytest.mark.parametrize("start,env,expected", [
    ([], {}, ExitCode.PREEMPTED),
    (["--no-warm-start"], {"NVRX_PREEMPTED_EXIT_CODE": "0"}, 0),
], ids=["warm", "cold-requeue-code-0"])
def test_sigterm_to_every_process_of_the_step_saves_and_exits_preempted(tmp_path, start, env, expected):
    code, output, events, tree = run_job(tmp_path, start, [], "step", env)
    assert code == expected, output[-6000:]
    exit_event = _check_preempted(tmp_path, events, output)
    assert exit_event["process_exit_code"] == expected
    helpers = " ".join(command for command, _ in tree.values())
    assert "nvrx_core.ft.monitor" in helpers  # the step's signal reached the helpers too
    if not start:  # and the fork server: the launcher's child that is both workers' parent
        launcher = next(iter(tree))
        servers = [pid for pid, (_, parent) in tree.items()
                   if parent == launcher and [p for _, p in tree.values()].count(pid) == 2]
        assert len(servers) == 1, tree


def test_sigterm_to_the_launcher_alone_is_forwarded_to_the_workers(tmp_path):
    code, output, events, _ = run_job(tmp_path, [], [], "launcher")
    assert code == ExitCode.PREEMPTED, output[-6000:]
    _check_preempted(tmp_path, events, output)
    assert [r["signals"] for r in _reports(str(tmp_path))] == [["SIGTERM"], ["SIGTERM"]]  # forwarded, once


def test_workers_without_a_handler_are_stopped_and_the_launcher_exits_128_plus_the_signal(tmp_path):
    code, output, events, _ = run_job(tmp_path, [], ["--no-handler"], "launcher")
    assert code == 128 + signal.SIGTERM, output[-6000:]  # torchrun's answer
    [signaled] = kinds(events, "launcher_signaled")
    assert signaled["preempted"] is False
    assert signaled["exit_codes"] == {"0": -signal.SIGTERM, "1": -signal.SIGTERM}, signaled
    assert not kinds(events, "restart_begun")
    [incident] = find_incidents(events)  # the job lost its work: one incident, but no rank to blame
    assert (incident.verdict.kind, incident.verdict.culprits) == (attribution.SIGNALED, [])


def _catches(pid, sig):
    """Whether `pid` has a handler for `sig` (the kernel's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (sig - 1)))


def test_a_launcher_without_workers_yet_ends_preempted_on_a_stop_signal(tmp_path):
    """A hot spare waiting for a slot, or a node in its first rendezvous (here: the second node
    never comes), was killed by SIGTERM's default action (torch handles it only once workers
    run): Slurm then recorded the step as failed. NVRX_PREEMPTED_EXIT_CODE maps it as usual."""
    events_file = str(tmp_path / "events.jsonl")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NVRX_PREEMPTED_EXIT_CODE="0")
    env.pop("NVRX_EVENTS_FILE", None)
    launcher = warm_python.popen(
        ["-m", "nvrx_core.ft.command", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "alone", "--events-file", events_file,
         JOB, "--out", str(tmp_path)],
        stdout=warm_python.PIPE, stderr=warm_python.STDOUT, text=True, env=env, start_new_session=True,
        preload=warm_python.LAUNCHER)
    try:
        wait_for(lambda: _catches(launcher.pid, signal.SIGTERM), timeout=120, what="the launcher handling SIGTERM")
        tree = [launcher.pid, *sorted(descendants(launcher.pid))]
        output = _sigterm_and_reap(launcher, tree, tree, timeout=120)
    finally:
        _kill_launcher(launcher)
    assert launcher.returncode == 0, output[-4000:]
    events = read_events(events_file)
    assert not kinds(events, "workers_started")
    [signaled] = kinds(events, "launcher_signaled")
    assert (signaled["signal"], signaled["preempted"], signaled["exit_codes"]) == ("SIGTERM", True, {}), signaled
    [exit_event] = kinds(events, "launcher_exit")
    assert (exit_event["exit_code"], exit_event["process_exit_code"]) == (ExitCode.PREEMPTED, 0)
    assert find_incidents(events) == []
