"""plan_round: who is in a round and with which group rank (no store, no processes)."""

import pytest

from nvrx_core.ft.rendezvous_round import Arrival, RendezvousConflictError, RoundResult, plan_round


def arrivals(*nodes, infra=None):
    return [Arrival(n, None if infra is None else infra[i], i + 1) for i, n in enumerate(nodes)]


def plan(round_number, arrived, previous=None, lost=(), min_nodes=2, max_nodes=2, last_call=False, infra=False,
         alive=()):
    return plan_round(round_number, arrived, previous, set(lost), min_nodes, max_nodes, last_call, infra, set(alive))


def test_first_round_fills_in_arrival_order_and_the_extra_node_waits_as_a_spare():
    result = plan(1, arrivals("a", "b", "c"))
    assert result.nodes() == ["a", "b"] and result.spares == ["c"]
    assert result.group_rank("b") == 1 and result.group_rank("c") is None


def test_first_round_waits_for_the_maximum_until_the_last_call_then_closes_with_the_minimum():
    assert plan(1, arrivals("a", "b"), min_nodes=2, max_nodes=3) is None
    assert plan(1, arrivals("a", "b"), min_nodes=2, max_nodes=3, last_call=True).nodes() == ["a", "b"]
    assert plan(1, arrivals("a"), min_nodes=2, max_nodes=3, last_call=True) is None


def test_a_restart_without_loss_keeps_every_rank_and_the_spare_stays_a_spare():
    first = RoundResult(1, {0: "b", 1: "a"})
    result = plan(2, arrivals("c", "a", "b"), first)  # the spare arrived first
    assert result.slots == {0: "b", 1: "a"} and result.spares == ["c"] and result.activated == []


def test_the_round_waits_for_a_live_previous_node_even_when_a_spare_could_fill_in():
    first = RoundResult(1, {0: "a", 1: "b"})
    assert plan(2, arrivals("c", "a"), first) is None


def test_a_spare_takes_exactly_the_lost_nodes_slot_and_survivors_keep_theirs():
    first = RoundResult(1, {0: "a", 1: "b", 2: "d"})
    result = plan(2, arrivals("c", "d", "a"), first, lost={"b"}, min_nodes=3, max_nodes=3)
    assert result.slots == {0: "a", 1: "c", 2: "d"}
    assert result.activated == ["c"] and result.lost == ["b"] and result.group_rank("c") == 1


def test_without_a_spare_the_round_waits_for_a_replacement_then_gives_it_the_slot():
    first = RoundResult(1, {0: "a", 1: "b"})
    assert plan(2, arrivals("a"), first, lost={"b"}) is None
    result = plan(2, arrivals("a", "e"), first, lost={"b"})
    assert result.slots == {0: "a", 1: "e"}


def test_an_elastic_job_shrinks_to_the_minimum_at_once_when_no_spare_is_there():
    first = RoundResult(1, {0: "a", 1: "b", 2: "c"})
    result = plan(2, arrivals("a", "c"), first, lost={"b"}, min_nodes=2, max_nodes=3)
    assert result.nodes() == ["a", "c"] and result.group_rank("c") == 1


def test_infra_ranks_place_nodes_and_spares_in_infra_order():
    arrived = arrivals("x", "y", "s2", "s3", infra=[1, 0, 3, 2])
    result = plan(1, arrived, infra=True)
    assert result.slots == {0: "y", 1: "x"} and result.spares == ["s3", "s2"]
    assert result.infra_ranks == {"x": 1, "y": 0}


def test_with_infra_ranks_a_spare_never_takes_a_slot_whose_owner_has_not_arrived():
    assert plan(1, arrivals("y", "s", infra=[0, 2]), infra=True) is None


def test_with_infra_ranks_the_lowest_spare_inherits_the_lost_nodes_rank():
    first = RoundResult(1, {0: "y", 1: "x"}, infra_ranks={"y": 0, "x": 1})
    result = plan(2, arrivals("s3", "s2", "x", infra=[3, 2, 1]), first, lost={"y"}, infra=True)
    assert result.slots == {0: "s2", 1: "x"} and result.activated == ["s2"] and result.spares == ["s3"]


@pytest.mark.parametrize("arrived, previous, expected", [
    (arrivals("x", "y", infra=[0, 0]), None, "nodes x and y both claim infra group rank 0"),
    (arrivals("s", infra=[0]), RoundResult(1, {0: "x"}, infra_ranks={"x": 0}),  # x is training, alive
     "nodes x and s both claim infra group rank 0"),
    (arrivals("x", "y", infra=[0, None]), None, "node y has no infra group rank"),
])
def test_conflicting_infra_ranks_are_an_error_naming_the_nodes(arrived, previous, expected):
    with pytest.raises(RendezvousConflictError, match=expected):
        plan(2 if previous else 1, arrived, previous, infra=True, alive={"x"})


def test_a_claim_on_the_rank_of_a_node_not_seen_alive_waits_until_that_node_is_lost_or_back():
    first = RoundResult(1, {0: "x", 1: "y"}, infra_ranks={"x": 0, "y": 1})
    assert plan(2, arrivals("x", "y2", infra=[0, 1]), first, infra=True) is None  # y may be dead
    assert plan(2, arrivals("x", "y2", infra=[0, 1]), first, lost={"y"}, infra=True).slots == {0: "x", 1: "y2"}


def test_a_lost_nodes_infra_rank_may_be_claimed_by_its_replacement():
    first = RoundResult(1, {0: "x", 1: "y"}, infra_ranks={"x": 0, "y": 1})
    result = plan(2, arrivals("x", "y2", infra=[0, 1]), first, lost={"y"}, infra=True)
    assert result.slots == {0: "x", 1: "y2"}


def test_results_survive_their_json_form():
    result = RoundResult(3, {0: "a", 2: "c"}, spares=["d"], lost=["b"], activated=["c"], infra_ranks={"a": 0})
    assert RoundResult.from_json(result.to_json()) == result
