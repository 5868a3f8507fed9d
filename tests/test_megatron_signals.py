"""nvrx_megatron.dist_signal_handler: Megatron's DistributedSignalHandler on nvrx_core.preemption.

One process: real signals, release/restore, re-entry, the registry refusing a second
owner, bad `sig`. Spawned gloo ranks: a signal on one rank is seen by every rank.
"""

import datetime
import json
import os
import signal
import socket

import pytest
import torch.distributed as dist
from harness import wait_for
from harness.ranks import run_spawned_ranks

from nvrx_core.config import ConfigError
from nvrx_core.durable import atomic_write_json
from nvrx_core.signals import SignalClaimError, SignalRegistry
from nvrx_megatron.dist_signal_handler import DistributedSignalHandler


def test_signal_received_while_entered_and_previous_handler_restored():
    previous = signal.getsignal(signal.SIGUSR1)
    handler = DistributedSignalHandler(signal.SIGUSR1)
    assert handler.released and handler.release() is False  # nothing held yet
    with handler as entered:
        assert entered is handler and not handler.released
        assert handler.signals_received() == [False]
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: handler.signaled, what="the signal recorded")
        assert handler.signals_received() == [True]
        assert handler.core.should_stop(1) is True  # a received signal is the agreed preemption
    assert handler.released and handler.release() is False
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_release_returns_true_once_and_reentry_starts_clean():
    handler = DistributedSignalHandler("SIGUSR2")
    handler.__enter__()  # Megatron enters its global handler this way
    os.kill(os.getpid(), signal.SIGUSR2)
    wait_for(lambda: handler.signaled, what="the signal recorded")
    assert handler.release() is True
    assert handler.release() is False
    with handler:
        assert handler.signals_received() == [False]


def test_entering_twice_is_refused():
    handler = DistributedSignalHandler(signal.SIGUSR1)
    with handler:
        with pytest.raises(RuntimeError, match="already entered"):
            handler.__enter__()
    assert handler.released


def test_a_signal_held_by_another_owner_is_refused_naming_it():
    registry = SignalRegistry()
    other = registry.claim(signal.SIGUSR1, "inprocess restart", lambda *_: None)
    try:
        handler = DistributedSignalHandler(signal.SIGUSR1, signals=registry)
        with pytest.raises(SignalClaimError, match="inprocess restart"):
            handler.__enter__()
        assert handler.released
    finally:
        other.release()


def test_sig_spellings_and_bad_values_are_named():
    assert DistributedSignalHandler().sig is signal.SIGTERM  # Megatron's default
    assert DistributedSignalHandler(int(signal.SIGUSR1)).sig is signal.SIGUSR1
    assert DistributedSignalHandler("usr2").sig is signal.SIGUSR2
    with pytest.raises(ValueError, match="sig=SIGKILL"):
        DistributedSignalHandler(signal.SIGKILL)
    with pytest.raises(ValueError, match="sig='SIGNOPE'"):
        DistributedSignalHandler("SIGNOPE")
    with pytest.raises(ValueError, match="sig=100000"):
        DistributedSignalHandler(100000)
    with pytest.raises(ConfigError, match="sig=1.5"):
        DistributedSignalHandler(1.5)


def test_on_a_real_gloo_group_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with DistributedSignalHandler(signal.SIGUSR1) as handler:
            assert handler.signals_received() == [False]
            os.kill(os.getpid(), signal.SIGUSR1)
            wait_for(lambda: handler.signaled, what="the signal recorded")
            assert handler.signals_received() == [True]
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- real gloo ranks

SIGNALED_RANK = 1


def _rank_main(rank, world, port, out_dir):
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        with DistributedSignalHandler(signal.SIGTERM) as handler:
            before = handler.signals_received()
            if rank == SIGNALED_RANK:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler signalling one node first
                wait_for(lambda: handler.signaled, what="the signal recorded")
            dist.barrier()
            after = handler.signals_received()
            stop = handler.core.should_stop(10)
        atomic_write_json(os.path.join(out_dir, f"rank{rank}.json"),
                          {"before": before, "after": after, "stop": stop,
                           "restored": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL})
    finally:
        dist.destroy_process_group()


def test_a_signal_on_one_rank_is_seen_by_every_rank(tmp_path):
    world = 3
    run_spawned_ranks(_rank_main, world, str(tmp_path))
    expected = [r == SIGNALED_RANK for r in range(world)]
    for r in range(world):
        result = json.load(open(tmp_path / f"rank{r}.json"))
        assert result["before"] == [False] * world
        assert result["after"] == expected
        assert result["stop"] is True
        assert result["restored"] is True
