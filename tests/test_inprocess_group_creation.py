"""A rank stuck creating its gloo group, because the peer that should connect to it gave up, restarts cleanly.

The CI flake, made deterministic. In a gloo group of two ranks, the pair whose listening
address compares higher connects; the other waits for that connection, inside the
ProcessGroupGloo constructor, with no bound but 5x the group timeout (torch 2.13) and no
socket the abort could shut down. In CI the connecting rank got "Connection refused",
gave up (an exception: a normal restart for it) and the waiting rank sat there until the
hard timeout killed it.

Here the iteration's store is wrapped for iteration 0 so that, of ranks 0 and 1, the one
gloo makes the connecting side raises instead of connecting (it sees both addresses as
gloo publishes them). The other one, and any rank waiting on a pair with the failed rank,
is stuck exactly as in CI. Every rank must restart and finish, none may be killed.
"""

import datetime
import os
import re
import struct

import pytest
import torch
import torch.distributed as dist

from test_inprocess_multirank import FAST, WORLD, launch

PAIR = (0, 1)
_INET = re.compile(rb"\x02\x00(..)(....)\x00{8}", re.S)  # sockaddr_in: family, port, address, zeros
_INET6 = re.compile(rb"\x0a\x00(..)\x00{4}(.{16})", re.S)  # sockaddr_in6: family, port, flowinfo, address


def _listening_address(blob: bytes):
    """(address bytes, port as gloo compares it) of the first socket address in a gloo rendezvous blob."""
    for pattern in (_INET, _INET6):
        match = pattern.search(blob)
        if match:
            return match.group(2), struct.unpack("=H", match.group(1))[0]
    return None


class GivingUpStore(dist.Store):
    """The iteration's store, except that the connecting side of PAIR raises when it reads its peer's address."""

    def __init__(self, inner, rank):
        super().__init__()
        self.inner, self.rank, self.own = inner, rank, None

    def set(self, key, value):
        if self.own is None and self.rank in PAIR:
            self.own = _listening_address(bytes(value))
        return self.inner.set(key, value)

    def get(self, key):
        value = self.inner.get(key)
        peer = PAIR[1] if self.rank == PAIR[0] else PAIR[0]
        if self.rank in PAIR and self.own is not None and key.endswith(f"/{peer}"):
            theirs = _listening_address(bytes(value))
            if theirs is not None and self.own > theirs:  # gloo makes this rank connect to the peer
                raise RuntimeError(f"simulated: connecting to rank {peer} was refused; giving up")
        return value

    def add(self, key, value):
        return self.inner.add(key, value)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()


def stuck_creation_job(params):
    from nvrx_core.inprocess import RestartState, Wrapper

    seen = []

    @Wrapper(**FAST)
    def train(state: RestartState):
        seen.append((state.iteration, state.rank, state.world_size))
        if state.iteration == 0:
            timeout = datetime.timedelta(seconds=(FAST["soft_timeout"] + FAST["hard_timeout"]) / 2)
            dist.init_process_group("gloo", store=GivingUpStore(state.store, state.rank), rank=state.rank,
                                    world_size=state.world_size, timeout=timeout)
        else:
            state.init_process_group("gloo")
        for _ in range(4):
            dist.all_reduce(torch.ones(4))
        return state.rank

    return {"rank": train(), "iterations": seen, "pid": os.getpid()}


@pytest.mark.timeout(400)
def test_a_rank_stuck_in_gloo_group_creation_restarts_instead_of_being_killed(tmp_path):
    # Whether any rank is still waiting in the constructor when the abort comes depends on
    # timing: on a loaded node every rank may be interrupted before it reached the wait (seen in
    # a CI run: all restarted cleanly, none had been stuck). Such a run shows nothing about this
    # case, so the job runs again, up to three times, until one did; each run must recover.
    for attempt in range(3):
        released = _recovers(tmp_path / f"run{attempt}")
        if released:
            return
    pytest.fail("in three runs no rank was still waiting in gloo's group constructor when the abort came")


def _recovers(root):
    """Run the job; check every rank restarted and finished, none killed; the ranks released
    from a stuck group creation (the injected one never among them)."""
    root.mkdir()
    run = launch(root, stuck_creation_job, {}, timeout=120)
    assert run.codes == [0] * WORLD, run.explain()
    assert not run.kinds("rank_killed"), run.explain()
    for rank in range(WORLD):
        assert run.result(rank)["iterations"] == [[0, rank, WORLD], [1, rank, WORLD]], run.explain()
    failed = [e["rank"] for e in run.kinds("inprocess_interrupted") if e["cause"] == "exception"]
    # the pair's connecting side raised, as injected; on a loaded node another rank may also
    # fail its own connect to that rank while it goes (a clean restart too)
    injected = [rank for rank in failed if rank in PAIR]
    assert injected, run.explain()
    # Which ranks still wait in the constructor when the abort comes depends on timing: the
    # pair's other rank, or ranks waiting on a pair with the failed one (in a loaded CI run,
    # ranks 2 and 3 were the stuck ones).
    released = [rank for rank in range(WORLD) if "stuck creating a process group" in run.log(rank)]
    assert injected[0] not in released, run.explain()
    return released
