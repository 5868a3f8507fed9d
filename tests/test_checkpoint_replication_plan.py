"""Replica placement and the restore plan (pure functions: which step, which copy)."""

import pytest

from nvrx_core.checkpoint import LocalCheckpointConfig, LocalCheckpointManager
from nvrx_core.checkpoint.replication import (check_topology, plan_restore, replica_sources,
                                              replica_targets)
from nvrx_core.config import ConfigError


def test_replicas_go_to_the_same_local_rank_on_the_next_nodes():
    # 3 nodes x 4 ranks: rank 5 (node 1, local rank 1) -> ranks 9 (node 2) and 1 (node 0)
    assert replica_targets(5, 12, 4, 2) == [9, 1]
    assert replica_sources(5, 12, 4, 2) == [1, 9]
    for rank in range(12):
        assert rank not in replica_targets(rank, 12, 4, 2)
        assert {t // 4 for t in replica_targets(rank, 12, 4, 2)} & {rank // 4} == set()


@pytest.mark.parametrize("world,per_node,factor,match", [
    (8, 3, 1, "ranks_per_node=3: must divide the world size 8"),
    (4, 2, 2, "replication_factor=2: needs at least 3 nodes; this job has 2"),
])
def test_impossible_topologies_are_config_errors(world, per_node, factor, match):
    with pytest.raises(ConfigError, match=match):
        check_topology(world, per_node, factor)


def test_replication_needs_a_process_group(tmp_path):
    config = LocalCheckpointConfig(root_dir=str(tmp_path), replication_factor=1)
    with pytest.raises(ConfigError, match="needs torch.distributed"):
        LocalCheckpointManager(config=config, process_group=None)


def inv(own, held=None):
    return {"own": own, "held": {str(k): v for k, v in (held or {}).items()}, "bad": []}


def test_plan_prefers_own_copies_then_the_lowest_holder():
    inventories = [inv([10, 20], {2: [10, 20]}), inv([10, 20], {3: [10, 20]}),
                   inv([], {0: [10, 20]}), inv([], {1: [10, 20]})]
    assert plan_restore(inventories, set()) == (20, {0: 0, 1: 1, 2: 0, 3: 1})


def test_plan_skips_copies_found_bad_and_steps_some_rank_lacks():
    inventories = [inv([10, 20, 30]), inv([10, 20, 30]), inv([10, 20])]
    assert plan_restore(inventories, set())[0] == 20
    assert plan_restore(inventories, {(1, 1, 20)}) == (10, {0: 0, 1: 1, 2: 2})
    assert plan_restore([inv([]), inv([5])], set()) == (None, {})
