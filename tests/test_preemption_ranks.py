"""DistributedSignalHandler.signaled_ranks(): one flag per rank, and it counts as an agreement.

In one process (a world of one, no process group, and a real gloo group of one); the
multi-rank case runs through nvrx_megatron's facade in test_megatron_signals.py.
"""

import os
import signal
import socket

import pytest
import torch.distributed as dist
from harness import wait_for

from nvrx_core.events import EventLog, read_events
from nvrx_core.preemption import PREEMPTION_AGREED, DistributedSignalHandler, PreemptionConfig


def test_no_signal_gives_one_false_and_no_agreement():
    handler = DistributedSignalHandler(PreemptionConfig(signals=["SIGUSR1"]), process_group=None)
    with handler:
        assert handler.signaled_ranks() == [False]
        assert handler.should_stop(1) is False


def test_a_signal_is_seen_and_counts_as_agreed(tmp_path):
    events = EventLog(str(tmp_path / "events.jsonl"), rank=0)
    handler = DistributedSignalHandler(PreemptionConfig(signals=["SIGUSR1"], check_every_n_steps=10),
                                       process_group=None, events=events)
    with handler:
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: handler.signaled, what="the signal recorded")
        assert handler.signaled_ranks(step=3) == [True]
        assert handler.should_stop(7) is True  # not a check step: the agreement stands
    agreed = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == PREEMPTION_AGREED]
    assert len(agreed) == 1 and agreed[0]["step"] == 3


@pytest.fixture
def gloo_world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_on_a_real_gloo_group(gloo_world_of_one):
    handler = DistributedSignalHandler(PreemptionConfig(signals=["SIGUSR2"]))
    with handler:
        assert handler.signaled_ranks() == [False]
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_for(lambda: handler.signaled, what="the signal recorded")
        assert handler.signaled_ranks() == [True]
