"""The torch compatibility module fails loudly, naming the torch version and what is missing."""

import socket
import struct
import threading

import pytest
import torch
import torch.distributed as dist

from nvrx_core import torch_compat
from nvrx_core.ft.agent import FaultTolerantAgent
from nvrx_core.inprocess.abort import AbortProcessGroups, IterationConnections
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


def test_gloo_handshake_is_refused_on_a_torch_it_was_not_verified_with(monkeypatch):
    for tested in torch_compat.TESTED_TORCH_VERSIONS:
        torch_compat.check_gloo_handshake(tested + "+cpu")  # a build label does not matter
    with pytest.raises(TorchCompatError) as refused:
        torch_compat.check_gloo_handshake("2.99.0+cu130")
    text = str(refused.value)
    assert "torch 2.99.0+cu130" in text and "gloo's pair handshake" in text
    assert all(v in text for v in torch_compat.TESTED_TORCH_VERSIONS)
    # the in-process Wrapper refuses it when a wrapped call starts, not in the middle of an abort
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.raises(TorchCompatError, match="torch 2.99.0 has no gloo's pair handshake"):
        AbortProcessGroups(IterationConnections(), empty_cuda_cache=False)


def test_release_gloo_connection_waits_sends_each_sequence_number_on_its_own_connection():
    """The wire side of the handshake imitation (gloo's own reaction to it is
    test_inprocess_group_creation's): one connection per number, 8 bytes in host order, closed."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    received = []

    def accept(expected):
        for _ in range(expected):
            conn, _ = listener.accept()
            with conn:
                data = b""
                while chunk := conn.recv(64):  # ends when the sender closed its connection
                    data += chunk
                received.append(data)

    world_size = 2
    expected = len(torch_compat.gloo_sequence_numbers(world_size))
    acceptor = threading.Thread(target=accept, args=(expected,), daemon=True)
    acceptor.start()
    try:
        made = torch_compat.release_gloo_connection_waits([listener.getsockname()], world_size)
        acceptor.join(60)
        assert not acceptor.is_alive()
    finally:
        listener.close()
    assert made == expected == 2 * world_size + 2
    assert sorted(struct.unpack("=q", data)[0] for data in received) == list(range(expected))
