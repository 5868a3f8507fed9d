"""respawn-rank, the launcher's side: a dead worker replaced in place, its peers untouched.

The rules (`decide`), the policy's validation, the Wrapper's announcement files and the flags
are checked on their own; then real ft_launcher jobs of tests/scripts/respawn_probe.py (3
ranks, no torch.distributed: the Wrapper's side has tests of its own) are killed rank by rank:
a SIGKILLed rank that announced itself comes back as the same rank with incarnation 1 while the
other two keep their processes, and each rule that says "restart every worker" is seen to do so.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import warm_python
from harness.launcher import SCRIPTS, alive, kill_tree, kinds, start_ticks
from nvrx_core.config import ConfigError
from nvrx_core.events import read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.ft import launcher_args, warm_start
from nvrx_core.ft.respawn import Decision, RespawnPolicy, decide
from nvrx_core.ft.respawn_marker import announce_wrapper, marker_path, wrapper_pid
from nvrx_core.ft.timeouts import Timeouts
from nvrx_core.ft.watch import RankWatch, cycle_stats
from nvrx_core import torch_compat
from harness import wait_for

PROBE = os.path.join(SCRIPTS, "respawn_probe.py")
RESPAWN = ["--ft-restart-policy", "respawn-rank"]
pytestmark = pytest.mark.timeout(240)


# ---- the rules ---------------------------------------------------------------------------

POLICY = RespawnPolicy(max_respawns=2, window_s=100.0, min_uptime_s=5.0)


def rule(exit_code=-9, runs_wrapper=True, killed_as_hung=False, rank_starts=(), node_starts=(), now=1000.0,
         returned=False) -> Decision:
    return decide(POLICY, exit_code, runs_wrapper, killed_as_hung, list(rank_starts), list(node_starts), now,
                  returned=returned)


def test_a_wrapper_worker_that_died_on_its_own_is_respawned():
    assert rule().respawn
    assert rule(exit_code=-11).respawn                              # a segfault, as a SIGKILL (OOM killer)
    assert rule(rank_starts=[990.0], node_starts=[990.0]).respawn  # a replacement up for 10 s may die again


@pytest.mark.parametrize("kwargs, words", [
    (dict(exit_code=0), "exited 0"),
    (dict(exit_code=int(ExitCode.PREEMPTED)), "PREEMPTED"),
    (dict(exit_code=int(ExitCode.STRAGGLER_STOP)), "STRAGGLER_STOP"),
    (dict(exit_code=int(ExitCode.RERUN_RESUME_ELSEWHERE)), "RERUN_RESUME_ELSEWHERE"),
    (dict(exit_code=int(ExitCode.RERUN_VALIDATION_FAILED)), "RERUN_VALIDATION_FAILED"),
    (dict(exit_code=int(ExitCode.INPROCESS_GAVE_UP)), "the Wrapper gave up"),
    (dict(exit_code=1), "exited 1: an error the Wrapper did not handle"),
    (dict(returned=True), "returned its result"),
    (dict(runs_wrapper=False), "does not use the Wrapper with respawn"),
    (dict(killed_as_hung=True), "killed it as hung"),
    (dict(killed_as_hung=None), "could not say"),
    (dict(node_starts=[950.0, 990.0]), "budget is spent: 2 respawn(s)"),
    (dict(rank_starts=[997.5], node_starts=[997.5]), "died 2.5 s after its start"),
    (dict(rank_starts=[997.5], node_starts=[997.5], runs_wrapper=False), "died 2.5 s after its start"),
])
def test_each_rule_that_restarts_every_worker_says_why(kwargs, words):
    decision = rule(**kwargs)
    assert not decision.respawn and words in decision.reason, decision


def test_the_budget_is_a_sliding_window_over_the_whole_node():
    # two respawns of other ranks, one of them older than the window: one left
    assert rule(node_starts=[850.0, 990.0]).respawn
    assert not rule(node_starts=[950.0, 990.0]).respawn
    # the rank's own history does not count against the node's budget twice, nor replace it
    assert rule(rank_starts=[850.0], node_starts=[850.0]).respawn


@pytest.mark.parametrize("fields, words", [
    (dict(max_respawns=0), "max_respawns (--max-respawns)=0: must be an integer >= 1"),
    (dict(max_respawns=1.5), "max_respawns"),
    (dict(window_s=0), "window_s (--respawn-window)=0: must be > 0"),
    (dict(min_uptime_s=-1), "min_uptime_s=-1: must be >= 0"),
])
def test_the_policy_refuses_bad_values_naming_the_field(fields, words):
    with pytest.raises(ConfigError) as e:
        RespawnPolicy(**fields)
    assert words in str(e.value)


# ---- the Wrapper's announcement, the node monitor's hung pids, torch's names -----------------

def test_an_announcement_names_the_pid_that_wrote_it_last(tmp_path):
    assert wrapper_pid(str(tmp_path), 3) is None
    announce_wrapper(str(tmp_path), 3, 1234)
    assert wrapper_pid(str(tmp_path), 3) == 1234
    announce_wrapper(str(tmp_path), 3, 5678)  # the replacement's own
    assert wrapper_pid(str(tmp_path), 3) == 5678 and wrapper_pid(str(tmp_path), 2) is None
    assert sorted(os.listdir(tmp_path)) == ["rank3"]  # no temp file left behind
    with open(marker_path(str(tmp_path), 4), "w") as f:
        f.write("12")  # cut short: a number still, but never a half-written one from announce_wrapper
    with open(marker_path(str(tmp_path), 5), "w") as f:
        f.write("garbage")
    assert wrapper_pid(str(tmp_path), 4) == 12 and wrapper_pid(str(tmp_path), 5) is None


def test_the_monitor_names_the_pids_it_took_down_as_hung():
    def watch(pid, expired, cycle=4):
        return RankWatch(rank=pid, local_rank=0, pid=pid, cycle=cycle, connected_at=0.0, timeouts=Timeouts(),
                         expired=expired)

    stats = cycle_stats(4, [watch(10, True), watch(11, False)], [watch(12, True), watch(13, True, cycle=3)])
    assert stats["hung_pids"] == [10, 12] and stats["ranks"] == 2


def test_torch_still_has_what_a_replacement_runs(monkeypatch):
    torch_compat.check_worker_respawn()
    from torch.distributed.elastic.multiprocessing import api

    monkeypatch.setattr(api, "_wrap", lambda local_rank, fn, args: None)
    with pytest.raises(torch_compat.TorchCompatError, match="_wrap.*its _wrap takes"):
        torch_compat.check_worker_respawn()


# ---- flags -----------------------------------------------------------------------------------

def settings_for(*flags):
    args = launcher_args.build_parser().parse_args([*flags, PROBE])
    return launcher_args.check_args(args)


def test_the_flags_build_the_policy_and_the_default_policy_has_none():
    assert settings_for().respawn is None
    assert settings_for(*RESPAWN).respawn == RespawnPolicy()
    policy = settings_for(*RESPAWN, "--max-respawns", "1", "--respawn-window", "60").respawn
    assert (policy.max_respawns, policy.window_s) == (1, 60.0)


@pytest.mark.parametrize("flags, words", [
    (["--no-warm-start"], "--no-warm-start"),
    (["--no-python"], "--no-python"),
    (["--run-path"], "--run-path"),
    (["--max-respawns", "0"], "--max-respawns"),
    (["--respawn-window", "-3"], "--respawn-window"),
])
def test_respawn_needs_the_warm_fork_server_and_sane_limits(flags, words):
    with pytest.raises(ConfigError) as e:
        settings_for(*RESPAWN, *flags)
    assert words in str(e.value)


def test_min_healthy_is_still_refused():
    with pytest.raises(ConfigError, match="any-failed"):
        settings_for("--ft-restart-policy", "min-healthy")


def test_the_fork_server_preloads_the_wrapper_under_the_policy():
    assert "nvrx_core.inprocess" in warm_start.early_preload([*RESPAWN, PROBE])
    assert "nvrx_core.inprocess" in warm_start.early_preload(["--restart_policy=respawn-rank", PROBE])
    assert "nvrx_core.inprocess" not in warm_start.early_preload([PROBE])
    assert warm_start.early_preload(["--warm-start-preload", "json", *RESPAWN, PROBE])[-2:] == \
        ["json", "nvrx_core.inprocess"]


# ---- real jobs ---------------------------------------------------------------------------------

class Job:
    """One ft_launcher run of respawn_probe.py with 3 ranks; its output goes to a file, so a test
    can wait on what the launcher said while it runs."""

    def __init__(self, directory, flags, probe_flags=()):
        self.dir = directory
        self.out = directory / "out"
        self.out.mkdir(parents=True)
        self.events_file = str(directory / "events.jsonl")
        self.log_path = directory / "launcher.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        for name in ("FAULT_TOL_FINISHED_FLAG_FILE", "NVRX_EVENTS_FILE", "NVRX_RESTART_POLICY", "NVRX_RESPAWN_DIR"):
            env.pop(name, None)
        self.pids_seen = {}
        with open(self.log_path, "w") as log:
            self.proc = warm_python.popen(
                ["-m", "nvrx_core.ft.command", "--nproc-per-node", "3", "--max-restarts", "2",
                 "--monitor-interval", "0.1", "--events-file", self.events_file, *flags,
                 PROBE, "--out", str(self.out), *probe_flags],
                stdout=log, stderr=warm_python.STDOUT, env=env, start_new_session=True, preload=warm_python.LAUNCHER)

    def starts(self):
        """[(rank, pid, incarnation, restart count)] in the order the processes wrote them."""
        try:
            lines = (self.out / "starts").read_text().splitlines()
        except FileNotFoundError:
            return []
        found = [tuple(int(x) for x in line.split()) for line in lines if len(line.split()) == 4]
        for _, pid, _, _ in found:
            self.pids_seen.setdefault(pid, start_ticks(pid))
        return found

    def wait_starts(self, predicate, what):
        wait_for(lambda: predicate(self.starts()), timeout=60, what=what)
        return self.starts()

    def first_cycle(self):
        found = self.wait_starts(lambda s: len(s) >= 3, "the 3 ranks started")
        return {rank: pid for rank, pid, incarnation, count in found if (incarnation, count) == (0, 0)}

    def running(self, pid):
        ticks = self.pids_seen.get(pid)
        return ticks is not None and alive(pid, ticks)

    def log(self):
        return self.log_path.read_text()

    def events(self):
        return read_events(self.events_file)

    def wait_event(self, kind, what=None):
        wait_for(lambda: kinds(self.events(), kind), timeout=60, what=what or f"a {kind} event")
        return kinds(self.events(), kind)

    def finish(self, timeout=60):
        (self.out / "go").touch()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher did not end within {timeout} s:\n{self.log()[-4000:]}") from None

    def close(self):
        kill_tree(self.proc.pid)
        for pid in list(self.pids_seen):
            if self.running(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def job(tmp_path):
    started = []

    def start(*flags, probe_flags=()):
        started.append(Job(tmp_path / f"job{len(started)}", flags, probe_flags))
        return started[-1]

    yield start
    for one in started:
        one.close()


def assert_every_rank_restarted(job, cycle=1):
    found = job.wait_starts(lambda s: {r for r, _, i, c in s if (i, c) == (0, cycle)} == {0, 1, 2},
                            f"every rank restarted in cycle {cycle}")
    return {rank: pid for rank, pid, incarnation, count in found if (incarnation, count) == (0, cycle)}


def test_a_killed_rank_is_respawned_and_its_peers_keep_their_processes(job):
    run = job(*RESPAWN)
    first = run.first_cycle()
    killed = time.time()
    os.kill(first[1], signal.SIGKILL)
    found = run.wait_starts(lambda s: any(r == 1 and i == 1 for r, _, i, _ in s), "rank 1's replacement")
    replacement_seen = time.time()
    [(_, new_pid, _, restart_count)] = [s for s in found if s[0] == 1 and s[2] == 1]
    assert new_pid != first[1] and restart_count == 0  # the dead worker's TORCHELASTIC_RESTART_COUNT
    assert json.loads((run.out / f"env.{new_pid}").read_text())["NVRX_RANK_INCARNATION"] == "1"
    assert run.running(first[0]) and run.running(first[2]) and run.running(new_pid)
    [respawned] = run.wait_event("rank_respawned")
    assert (respawned["rank"], respawned["local_rank"], respawned["old_pid"], respawned["new_pid"],
            respawned["incarnation"], respawned["exit_code"]) == (1, 1, first[1], new_pid, 1, -signal.SIGKILL)
    assert run.finish() == 0, run.log()[-4000:]
    events = run.events()
    assert not kinds(events, "restart_begun") and not kinds(events, "workers_failed")
    assert not kinds(events, "respawn_declined") and kinds(events, "training_finished")
    assert sorted((r, i) for r, _, i, _ in run.starts()) == [(0, 0), (1, 0), (1, 1), (2, 0)]  # 0 and 2 never again
    assert "respawned it as pid %d (incarnation 1)" % new_pid in run.log()
    print(f"\nSIGKILL -> replacement started (rank_respawned): {respawned['time'] - killed:.3f} s "
          f"(death seen -> started: {respawned['seconds']:.3f} s); SIGKILL -> the replacement's script "
          f"running: <= {replacement_seen - killed:.3f} s", file=sys.stderr)


def test_the_launchers_respawn_directory_is_private_and_removed_at_exit(job):
    run = job(*RESPAWN)
    first = run.first_cycle()
    env = json.loads((run.out / f"env.{first[0]}").read_text())
    directory = env["NVRX_RESPAWN_DIR"]
    assert (env["NVRX_RESTART_POLICY"], env["NVRX_RANK_INCARNATION"]) == ("respawn-rank", "0")
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert sorted(os.listdir(directory)) == ["rank0", "rank1", "rank2"]
    assert run.finish() == 0, run.log()[-4000:]
    assert not os.path.exists(directory)


def test_a_worker_that_did_not_announce_itself_restarts_every_worker(job):
    run = job(*RESPAWN, probe_flags=["--no-announce-rank", "1"])
    first = run.first_cycle()
    os.kill(first[1], signal.SIGKILL)
    [declined] = run.wait_event("respawn_declined")
    assert (declined["rank"], declined["exit_code"]) == (1, -signal.SIGKILL)
    assert "does not use the Wrapper with respawn" in declined["reason"]
    assert_every_rank_restarted(run)
    assert run.finish() == 0, run.log()[-4000:]
    events = run.events()
    assert len(kinds(events, "restart_begun")) == 1 and not kinds(events, "rank_respawned")


def test_a_replacement_that_dies_at_once_restarts_every_worker(job):
    run = job(*RESPAWN, probe_flags=["--crash-replacements"])
    first = run.first_cycle()
    os.kill(first[2], signal.SIGKILL)
    [declined] = run.wait_event("respawn_declined")
    [respawned] = kinds(run.events(), "rank_respawned")
    assert (respawned["rank"], declined["rank"], declined["exit_code"]) == (2, 2, 3)
    assert "it was a replacement and died" in declined["reason"]
    assert_every_rank_restarted(run)
    assert run.finish() == 0, run.log()[-4000:]
    assert len(kinds(run.events(), "restart_begun")) == 1


def test_the_respawn_budget_spent_restarts_every_worker(job):
    run = job(*RESPAWN, "--max-respawns", "1")
    first = run.first_cycle()
    os.kill(first[1], signal.SIGKILL)
    run.wait_event("rank_respawned")
    os.kill(first[0], signal.SIGKILL)
    [declined] = run.wait_event("respawn_declined")
    assert declined["rank"] == 0 and "budget is spent: 1 respawn(s)" in declined["reason"]
    assert_every_rank_restarted(run)
    assert run.finish() == 0, run.log()[-4000:]
    events = run.events()
    assert len(kinds(events, "restart_begun")) == 1 and len(kinds(events, "rank_respawned")) == 1


def test_a_rank_the_node_monitor_killed_as_hung_restarts_every_worker(job):
    run = job(*RESPAWN, "--ft-initial-rank-heartbeat-timeout", "60", "--ft-rank-heartbeat-timeout", "3",
              probe_flags=["--heartbeats", "--hang-rank", "1"])
    run.first_cycle()
    declined = run.wait_event("respawn_declined", "the hung rank's kill")
    assert any(e["rank"] == 1 and "killed it as hung" in e["reason"] for e in declined), declined
    assert any(e["rank"] == 1 for e in kinds(run.events(), "fault_detected"))
    assert_every_rank_restarted(run)
    assert run.finish() == 0, run.log()[-4000:]
    assert not kinds(run.events(), "rank_respawned")


def test_a_worker_that_exits_0_early_is_left_alone(job):
    run = job(*RESPAWN, probe_flags=["--exit-early-rank", "2"])
    first = run.first_cycle()
    wait_for(lambda: f"rank 2 (pid {first[2]}) exited 0; left as it is" in run.log(), timeout=60,
             what="the launcher saw rank 2 exit 0")
    assert run.running(first[0]) and run.running(first[1]) and not run.running(first[2])
    events = run.events()
    assert not [e for e in events if e["kind"] in ("rank_respawned", "respawn_declined", "workers_failed")]
    # the watcher goes on after an exit 0: a later death is still respawned
    os.kill(first[1], signal.SIGKILL)
    [respawned] = run.wait_event("rank_respawned")
    assert respawned["rank"] == 1
    replacement = respawned["new_pid"]
    # (a warm worker ignores a stop signal until its script starts, as the fork server does)
    run.wait_starts(lambda s: any(pid == replacement for _, pid, _, _ in s), "the replacement running")
    # rank 2 never handed torch a result, so the job cannot end by itself (as under torchrun): a
    # stop signal ends it, and what it stops is not respawned
    run.proc.send_signal(signal.SIGTERM)
    try:
        code = run.proc.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError(run.log()[-4000:]) from None
    assert code == 128 + signal.SIGTERM, run.log()[-4000:]
    assert not run.running(first[0]) and not run.running(replacement)
    events = run.events()
    assert len(kinds(events, "rank_respawned")) == 1 and not kinds(events, "respawn_declined")
    assert not kinds(events, "restart_begun")
