"""The Wrapper's side of respawn-rank: a dead rank's replacement rejoins the others' job, and
roll_forward brings it the newest committed state. examples/respawn_ddp.py (4 gloo ranks, DDP,
SGD with momentum, 50 ms steps) runs around a store held here; a rank killed by a signal is
started again at once (replacing_ranks.py), as ft_launcher --ft-restart-policy respawn-rank
does. Every faulted run must end with the weights of the run without a fault, bit for bit."""

import threading

import pytest
import torch
import torch.distributed as dist

import replacing_ranks
from harness.committed_steps import check_committed_steps
from harness.ranks import run_spawned_ranks
from nvrx_core.inprocess import InProcessConfig
from nvrx_core.inprocess.coordination import Coordinator
from nvrx_core.inprocess.errors import InProcessGaveUp
from nvrx_core.inprocess.planning import first_plan, next_plan
from nvrx_core.inprocess.rank_assignment import default_policy
from nvrx_core.inprocess.records import Cause
from nvrx_core.inprocess.replacement import wait_for_replacements
from nvrx_core.inprocess import roll_forward as roll_forward_module
from nvrx_core.inprocess.roll_forward import _buckets, _flatten, roll_forward
from harness.stores import host_store

STEPS = "40"
FAST = ("--steps", STEPS, "--step-time", "0.02")   # the steps' padding only sleeps: same data, same weights


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    result = replacing_ranks.run(str(tmp_path_factory.mktemp("fault_free")), *FAST)
    weights = result.weights()
    assert len(weights) == 4 and len(set(weights.values())) == 1, weights
    return weights[0]


def check_rolled_forward(result, fault_free, killed_ranks):
    """Equal weights; no process redid a step and every step was committed (harness.committed_steps); only
    the killed ranks changed process."""
    assert set(result.weights().values()) == {fault_free}, result.exits
    check_committed_steps({rank: [(s, p) for s, _, p in result.steps(rank)] for rank in range(4)}, int(STEPS))
    for rank in range(4):
        pids = {p for _, _, p in result.steps(rank)}
        assert (len(pids) > 1) == (rank in killed_ranks), (rank, pids)
    assert all(code == 0 for rank, pid, code in result.exits if code >= 0), result.exits


def test_a_killed_rank_is_replaced_alone_and_training_rolls_forward(tmp_path, fault_free):
    result = replacing_ranks.run(str(tmp_path), *FAST, "--fault", "kill:2:15")
    check_rolled_forward(result, fault_free, killed_ranks={2})
    assert result.respawns == 1
    [killed] = result.kill_times()
    old, new = [p for _, _, p in result.steps(2)[14:16]]
    assert old != new                     # step 15 by the old process, the next record by its replacement


def test_two_ranks_killed_50ms_apart(tmp_path, fault_free):
    result = replacing_ranks.run(str(tmp_path), *FAST, "--fault", "kill:1:12",
                                 "--fault", "kill:3:12:0.05")
    check_rolled_forward(result, fault_free, killed_ranks={1, 3})
    assert result.respawns == 2


@pytest.mark.parametrize("who", [0, 3], ids=["the_serving_rank", "a_receiving_survivor"])
def test_a_rank_killed_as_the_state_transfer_begins(tmp_path, fault_free, who):
    """Rank 0 is the lowest rank with the newest step: it serves the state; rank 3 takes part."""
    result = replacing_ranks.run(str(tmp_path), *FAST, "--fault", "kill:2:10",
                                 "--fault", f"kill_in_roll:{who}")
    check_rolled_forward(result, fault_free, killed_ranks={2, who})
    assert result.respawns == 2


def test_the_replacement_killed_as_it_joins(tmp_path, fault_free):
    result = replacing_ranks.run(str(tmp_path), *FAST, "--fault", "kill:2:10",
                                 "--fault", "kill_replacement:2")
    check_rolled_forward(result, fault_free, killed_ranks={2})
    assert result.respawns == 2


# ---- the pieces, one at a time -------------------------------------------------------------

def test_a_respawn_plan_keeps_every_place_and_awaits_the_dead_rank():
    config = InProcessConfig()
    plan = first_plan(["n0", "n0", "n1", "n1"], config)
    after = next_plan(plan, [], {2: Cause.EXITED.value}, config, default_policy("rank"), marked=3,
                      generations={2: 1})
    assert after.iteration == 1 and after.assignment.active == plan.assignment.active
    assert after.awaiting == {2: 1} and after.causes == {} and after.marked == 3 and after.faults == {2: 1}
    assert type(after).from_json(after.to_json(), plan.assignment.nodes) == after
    shrunk = next_plan(plan, [], {2: Cause.EXITED.value}, config, default_policy("rank"))
    assert shrunk.awaiting == {} and shrunk.assignment.world_size == 3   # without respawn: as before


def test_a_revived_rank_is_no_longer_terminated_and_can_die_again():
    server = host_store()
    survivor, dead = (Coordinator(dist.TCPStore("127.0.0.1", server.port, is_master=False), "p", r) for r in (0, 1))
    assert survivor.mark_terminated(1, Cause.EXITED)
    assert survivor.terminations() == ({1: "exited"}, 1)
    survivor.await_replacement(1, survivor.generation(1), iteration=1)
    assert dead.awaited_at(dead.generation(1), timeout=5) == 1
    dead.revive()
    assert survivor.terminations() == ({}, 1) and survivor.generation(1) == 1
    assert not survivor.mark_terminated(1, Cause.HEARTBEAT_LOST, generation=0)   # about the process replaced
    assert survivor.mark_terminated(1, Cause.EXITED)                             # the replacement itself
    assert survivor.terminations() == ({1: "exited"}, 2)


def test_survivors_wait_for_the_replacement_then_go_on_or_give_up():
    server = host_store()
    survivor, dead = (Coordinator(dist.TCPStore("127.0.0.1", server.port, is_master=False), "p", r) for r in (0, 1))
    survivor.mark_terminated(1, Cause.EXITED)
    config = InProcessConfig()
    plan = next_plan(first_plan(["n", "n"], config), [], survivor.terminated(), config, default_policy("rank"),
                     marked=1, generations={1: 0})
    with pytest.raises(InProcessGaveUp, match=r"no replacement of rank\(s\) \[1\] joined within respawn_timeout=0.3 s") as gave_up:
        wait_for_replacements(survivor, plan, timeout=0.3)
    assert gave_up.value.code == 22                            # the process ends so; the launcher restarts all
    threading.Timer(0.2, dead.revive).start()
    assert wait_for_replacements(survivor, plan, timeout=30) is None
    survivor.mark_terminated(0, Cause.EXITED)                  # another death meanwhile: restart instead
    assert "died while the others waited" in wait_for_replacements(survivor, plan, timeout=30)


def _roll(rank, world, port, out_dir):
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(rank)                                   # every rank's tensors differ at first
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    progress = {"epoch": rank, "samples": [rank]}
    if rank != 1:                                             # rank 1 is fresh: its Adam has no state
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    state = type("State", (), {"rank": rank, "respawned": frozenset({1})})()
    committed = {0: 7, 1: 9, 2: 8}[rank]                       # rank 1's 9 does not count: it is fresh
    weight_memory = model.weight.data_ptr()
    step = roll_forward(state, committed, {"model": model, "optimizer": optimizer, "progress": progress})
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    moments = torch.cat([optimizer.state[p]["exp_avg"].flatten() for p in model.parameters()])
    torch.save({"step": step, "weights": weights, "moments": moments, "progress": progress,
                "adam_step": [optimizer.state[p]["step"] for p in model.parameters()],
                "weight_in_place": model.weight.data_ptr() == weight_memory}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_roll_forward_sends_the_newest_committed_state_to_every_rank_that_lacks_it(tmp_path):
    """Rank 2 committed step 8, rank 0 step 7, rank 1 is a replacement: all three end with rank 2's
    model, Adam moments (created on rank 1, which had none), progress dict, at step 8."""
    run_spawned_ranks(_roll, 3, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for result in results:
        assert result["step"] == 8
        assert torch.equal(result["weights"], results[2]["weights"])
        assert torch.equal(result["moments"], results[2]["moments"])
        assert result["progress"] == {"epoch": 2, "samples": [2]}
        assert [int(s) for s in result["adam_step"]] == [1, 1]
        assert result["weight_in_place"]                      # received into the model's own tensors


def test_roll_forward_buckets_by_dtype_and_size(monkeypatch):
    """A few collectives for many small tensors; a bucket never mixes dtypes or grows past its bound."""
    monkeypatch.setattr(roll_forward_module, "BUCKET_BYTES", 64)
    f32, u8 = torch.float32, torch.uint8
    specs = [("a", f32, [4]), ("b", f32, [2, 2]), ("c", f32, []), ("d", u8, [8]), ("e", f32, [32]), ("f", f32, [1])]
    assert [[path for path, _, _ in bucket] for bucket in _buckets(specs)] == [["a", "b", "c"], ["d"], ["e"], ["f"]]


def test_state_that_cannot_travel_is_named():
    with pytest.raises(TypeError, match=r"roll_forward: /'optimizer'/'hook' is a function"):
        _flatten({"optimizer": {"hook": lambda: None}})
    structure, tensors = _flatten({"m": {0: torch.zeros(2), "betas": (0.9, 0.99)}})
    assert list(tensors) == ["/'m'/0"] and structure["__dict__"][0][1]["__dict__"][1][1] == {"__tuple__": [0.9, 0.99]}
