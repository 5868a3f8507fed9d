"""Rank assignment policies and the restart plan: pure functions, no processes."""

import time

import pytest

from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.inprocess.planning import ACTIVE, OUT, RESERVE, Plan, first_plan, next_plan
from nvrx_core.inprocess.rank_assignment import (ActivateReserves, Assignment, DivisibleBy, FillGapsFromTop,
                                                 LimitWorldSize, RankAssignmentError, ShiftRanks,
                                                 check_assignment, compose, default_policy, initial_assignment,
                                                 mark_terminated)
from nvrx_core.inprocess.records import Cause, InterruptionRecord


def nodes(count, per_node=1):
    return [f"n{i // per_node}" for i in range(count)]


def test_initial_assignment_makes_the_top_ranks_reserves():
    a = initial_assignment(nodes(5), active_world_size=3)
    assert a.active == (0, 1, 2, None, None) and a.world_size == 3 and a.reserves() == [3, 4]
    with pytest.raises(RankAssignmentError, match="active_world_size=6"):
        initial_assignment(nodes(5), 6)


def test_shift_ranks_closes_gaps_keeping_order():
    a = ShiftRanks()(mark_terminated(initial_assignment(nodes(6)), {1, 3}))
    assert a.active == (0, None, 1, None, 2, 3)
    check_assignment(a)


def test_fill_gaps_from_top_moves_only_the_highest_ranks():
    a = FillGapsFromTop()(mark_terminated(initial_assignment(nodes(6)), {1, 4}))
    assert a.active == (0, None, 2, 3, None, 1)  # rank 5 moved into gap 1; gap 4 vanished at the top
    check_assignment(a)
    b = FillGapsFromTop()(mark_terminated(initial_assignment(nodes(4)), {2, 3}))
    assert b.active == (0, 1, None, None)


def test_activate_reserves_fills_gaps_then_shift_closes_what_is_left():
    start = initial_assignment(nodes(6), active_world_size=4)  # 4 and 5 are reserves
    a = ActivateReserves()(mark_terminated(start, {1}))
    assert a.active[4] == 1 and a.active[1] is None and a.world_size == 4
    b = compose(ActivateReserves(), ShiftRanks())(mark_terminated(start, {0, 1, 2}))
    assert b.active == (None, None, None, 2, 0, 1)  # reserves take gaps 0 and 1, rank 3 shifts to 2
    check_assignment(b)


def test_keep_whole_nodes_excludes_every_rank_on_a_faulty_node():
    start = initial_assignment(nodes(8, per_node=2), active_world_size=6)  # node n3 = reserves 6, 7
    a = default_policy("node")(mark_terminated(start, {3}))
    assert a.terminated == {2, 3}
    assert a.active == (0, 1, None, None, 4, 5, 2, 3)  # the reserve node takes the gaps
    check_assignment(a)
    assert default_policy("rank")(mark_terminated(start, {3})).terminated == {3}


def test_limit_and_divisible_by_turn_the_top_ranks_into_reserves():
    start = initial_assignment(nodes(8))
    a = compose(ShiftRanks(), DivisibleBy(4))(mark_terminated(start, {5}))
    assert a.world_size == 4 and a.active == (0, 1, 2, 3, None, None, None, None)
    assert LimitWorldSize(2)(start).world_size == 2
    with pytest.raises(ValueError):
        DivisibleBy(0)


def test_check_assignment_rejects_an_open_gap_or_duplicates():
    with pytest.raises(RankAssignmentError, match="gap not closed"):
        check_assignment(mark_terminated(initial_assignment(nodes(3)), {1}))
    with pytest.raises(RankAssignmentError, match="duplicated"):
        check_assignment(Assignment(("a", "b"), (0, 0)))
    with pytest.raises(RankAssignmentError, match="outside"):
        mark_terminated(initial_assignment(nodes(3)), {7})


def test_policies_take_milliseconds_for_16k_ranks():
    world = 16384
    start = initial_assignment(nodes(world, per_node=8), active_world_size=world - 64)
    lost = set(range(0, world, 97))
    policies = [default_policy("node"), default_policy("rank"), compose(FillGapsFromTop()),
                compose(ActivateReserves(), ShiftRanks(), DivisibleBy(8))]
    for policy in policies:
        began = time.perf_counter()
        result = check_assignment(policy(mark_terminated(start, lost)))
        elapsed = time.perf_counter() - began
        assert elapsed < 1.0, f"{policy} took {elapsed:.3f} s for {world} ranks"  # ~20 ms here; generous margin
        assert result.world_size > 0


# ---- the restart plan -------------------------------------------------------------------
def rec(rank, cause, first=False):
    return InterruptionRecord(rank, cause, "", rank, first)


def test_first_exception_is_the_fault_and_peers_are_consequences():
    config = InProcessConfig()
    plan = next_plan(first_plan(nodes(4), config),
                     [rec(1, Cause.EXCEPTION, first=True), rec(0, Cause.PEER_INTERRUPTED), rec(2, Cause.EXCEPTION)],
                     {}, config, default_policy("rank"))
    assert plan.iteration == 1 and plan.faults == {1: 1} and plan.give_up is None
    assert [plan.role(r) for r in range(4)] == [ACTIVE] * 4


def test_lost_ranks_take_the_blame_and_leave():
    config = InProcessConfig(active_world_size=3)
    plan = next_plan(first_plan(nodes(4), config), [rec(0, Cause.EXCEPTION, first=True)], {2: "exited"},
                     config, default_policy("rank"))
    assert plan.faults == {2: 1} and plan.causes == {2: "exited"}
    assert plan.role(2) == OUT and plan.role(3) == ACTIVE and plan.assignment.active[3] == 2
    assert plan.marked == 1


def test_max_rank_faults_excludes_and_min_world_gives_up():
    config = InProcessConfig(max_rank_faults=1, min_active_world_size=4)
    plan = first_plan(nodes(4), config)
    for _ in range(2):
        plan = next_plan(plan, [rec(3, Cause.EXCEPTION, first=True)], {}, config, default_policy("rank"))
    assert plan.causes == {3: "max_rank_faults"} and plan.role(3) == OUT
    assert "min_active_world_size=4" in plan.give_up


def test_max_iterations_gives_up():
    config = InProcessConfig(max_iterations=2)
    plan = next_plan(first_plan(nodes(2), config), [rec(0, Cause.EXCEPTION, True)], {}, config, ShiftRanks())
    assert plan.give_up is None
    plan = next_plan(plan, [rec(0, Cause.EXCEPTION, True)], {}, config, ShiftRanks())
    assert "max_iterations=2" in plan.give_up


def test_completion_timeout_gives_up():
    config = InProcessConfig()
    plan = next_plan(first_plan(nodes(2), config), [rec(0, Cause.COMPLETION_TIMEOUT, True)], {}, config, ShiftRanks())
    assert plan.give_up.startswith("completion_timeout=120.0 s expired") and plan.faults == {}


def test_plan_survives_the_store_round_trip():
    config = InProcessConfig(active_world_size=3)
    plan = next_plan(first_plan(nodes(4), config), [rec(1, Cause.SOFT_TIMEOUT, True)], {0: "hard_timeout"},
                     config, default_policy("rank"))
    again = Plan.from_json(plan.to_json(), nodes(4))
    assert again == plan
    assert again.role(3) == ACTIVE and again.role(0) == OUT and RESERVE not in [again.role(r) for r in range(4)]
