"""The torch compatibility module fails loudly, naming the torch version and what is missing."""

import pytest
import torch
import torch.distributed as dist

from nvrx_core import torch_compat
from nvrx_core.ft.agent import FaultTolerantAgent
from nvrx_core.torch_compat import TorchCompatError


def test_a_missing_name_is_an_error_naming_it_and_the_torch_version():
    class Owner:
        pass

    with pytest.raises(TorchCompatError) as e:
        torch_compat.require(Owner, "_gone", "something we rely on")
    text = str(e.value)
    assert "Owner._gone" in text and torch.__version__ in text and "something we rely on" in text
    assert all(v in text for v in torch_compat.TESTED_TORCH_VERSIONS)


def test_an_agent_base_without_a_hook_we_override_is_refused():
    base = type("LocalElasticAgent", (), {name: lambda self: None for name in torch_compat.AGENT_HOOKS[1:]})
    base.__module__ = "torch.distributed.elastic.agent.server.future"
    agent = type("Agent", (base,), {})
    with pytest.raises(TorchCompatError, match="_initialize_workers"):
        torch_compat.check_agent_hooks(agent)


def test_the_installed_torch_has_everything_we_use():
    torch_compat.check_agent_hooks(FaultTolerantAgent)
    parser, config_from_args, parse_min_max_nnodes = torch_compat.torchrun_cli()
    assert parse_min_max_nnodes("1:2") == (1, 2)
    assert parser().parse_args(["--nproc-per-node", "2", "train.py"]).nproc_per_node == "2"
    tensor = torch.zeros(2)
    assert torch_compat.tensor_use_count(tensor) == 1
    view = tensor.view(-1)
    assert torch_compat.tensor_use_count(tensor) == 2      # a view keeps its base alive
    del view
    assert torch_compat.tensor_use_count(tensor) == 1


def test_all_process_groups_lists_subgroups(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        groups = torch_compat.all_process_groups()
        assert dist.group.WORLD in groups and sub in groups
    finally:
        dist.destroy_process_group()
    assert torch_compat.all_process_groups() == []


def test_reset_group_counter_names_the_next_group_from_zero_again(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        dist.new_group([0])
        assert dist.distributed_c10d._world.group_count > 0
        torch_compat.reset_group_counter()
        assert dist.distributed_c10d._world.group_count == 0
    finally:
        dist.destroy_process_group()
