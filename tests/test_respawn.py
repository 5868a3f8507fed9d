"""ft_launcher --ft-restart-policy respawn-rank with the Wrapper: examples/respawn_ddp.py on 4 gloo
ranks (DDP, 50 ms steps, a checkpoint every 20 steps). A SIGKILLed rank is replaced alone, the
others keep their processes and training rolls forward, bit for bit; where the launcher
decides otherwise, every rank restarts from the checkpoint, bit for bit too."""

import glob
import os

import pytest

from harness.committed_steps import check_committed_steps
from harness.launcher import run_launcher
from nvrx_core.events import read_events
from nvrx_core.report.build import build_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "examples", "respawn_ddp.py")
STEPS = 40
RESPAWN = ["--ft-restart-policy", "respawn-rank"]


def launch(workdir, *job_args, policy=RESPAWN):
    events = os.path.join(workdir, "events.jsonl")
    result = run_launcher(["--nproc-per-node", "4", "--max-restarts", "2", "--monitor-interval", "0.1", *policy,
                           JOB, "--workdir", str(workdir), "--steps", str(STEPS), "--step-time", "0.02", *job_args],
                          env={"NVRX_EVENTS_FILE": events})
    return result, read_events(events)


def weights(workdir):
    found = {}
    for path in glob.glob(os.path.join(workdir, "weights.rank*")):
        with open(path) as f:
            found[path] = f.read()
    return set(found.values()) if len(found) == 4 else found


def steps(workdir, rank):
    with open(os.path.join(workdir, f"steps.rank{rank}")) as f:
        return [(int(s), int(p)) for s, _, p in (line.split() for line in f)]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fault_free")
    result, _ = launch(workdir)
    assert result.returncode == 0, result.stdout[-4000:]
    [digest] = weights(workdir)
    return digest


def test_a_killed_rank_is_respawned_alone_and_the_run_ends_as_without_the_fault(tmp_path, fault_free):
    result, events = launch(tmp_path, "--fault", "kill:2:20")
    assert result.returncode == 0, result.stdout[-4000:]
    assert weights(tmp_path) == {fault_free}
    [respawned] = [e for e in events if e["kind"] == "rank_respawned"]
    assert (respawned["rank"], respawned["exit_code"], respawned["incarnation"]) == (2, -9, 1)
    assert not [e for e in events if e["kind"] in ("restart_begun", "respawn_declined")]
    check_committed_steps({rank: steps(tmp_path, rank) for rank in range(4)}, STEPS)
    for rank in range(4):
        done = steps(tmp_path, rank)
        if rank == 2:  # killed after committing step 20; the replacement redoes 20 if no survivor had committed it
            assert done[:20] == [(s, respawned["old_pid"]) for s in range(1, 21)]
            # No survivor can commit 21 without rank 2 in its all-reduce: the newest live state is 19 or 20.
            assert done[20][0] in (20, 21), done
            assert done[20:] == [(s, respawned["new_pid"]) for s in range(done[20][0], STEPS + 1)], done
        else:
            assert len({p for _, p in done}) == 1                             # the others kept their process
    text = build_report(str(tmp_path / "events.jsonl")).text()
    assert "respawns: 1" in text and f"rank 2 (pid {respawned['old_pid']}) died (exit -9)" in text
    assert "incidents: 0" in text


@pytest.mark.parametrize("faults", [("kill:1:12", "kill:3:12:0.05"), ("kill:2:10", "kill_in_roll:0")],
                         ids=["two_ranks_50ms_apart", "the_serving_rank_as_the_transfer_begins"])
def test_a_second_death_during_the_recovery_is_one_more_respawn(tmp_path, fault_free, faults):
    result, events = launch(tmp_path, *(arg for fault in faults for arg in ("--fault", fault)))
    assert result.returncode == 0, result.stdout[-4000:]
    assert weights(tmp_path) == {fault_free}
    assert len([e for e in events if e["kind"] == "rank_respawned"]) == 2
    assert not [e for e in events if e["kind"] in ("restart_begun", "respawn_declined")]
    check_committed_steps({rank: steps(tmp_path, rank) for rank in range(4)}, STEPS)


def test_a_replacement_that_dies_at_once_falls_back_to_restarting_every_rank(tmp_path, fault_free):
    result, events = launch(tmp_path, "--fault", "kill:2:25", "--fault", "kill_replacement:2")
    assert result.returncode == 0, result.stdout[-4000:]
    assert weights(tmp_path) == {fault_free}                                  # resumed from step 20's checkpoint
    kinds = [e["kind"] for e in events if e["kind"] in ("rank_respawned", "respawn_declined", "restart_begun")]
    assert kinds == ["rank_respawned", "respawn_declined", "restart_begun"], kinds
    [declined] = [e for e in events if e["kind"] == "respawn_declined"]
    assert declined["rank"] == 2 and "min_uptime" in declined["reason"]
    assert [s for s, _ in steps(tmp_path, 0)][-20:] == list(range(21, STEPS + 1))  # redone from the checkpoint


def test_without_the_policy_a_killed_rank_restarts_every_rank_as_before(tmp_path, fault_free):
    result, events = launch(tmp_path, "--fault", "kill:2:25", policy=[])
    assert result.returncode == 0, result.stdout[-4000:]
    assert weights(tmp_path) == {fault_free}
    assert [e["kind"] for e in events if e["kind"] in ("rank_respawned", "respawn_declined")] == []
    assert len({p for _, p in steps(tmp_path, 0)}) == 2                         # rank 0 restarted too
