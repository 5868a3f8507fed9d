"""A recorded timeline for ranks: straggler tests decide rankings on it, not on the host's clock.

Each rank's detector reads a FakeClock (harness.clock) that a section advances by the duration
the test gives it. A collective on this timeline ends, on every rank, when the last rank arrived:
`all_arrive` all-reduces the arrival times for real (MAX over the process group) and moves the
rank's clock to that moment, then by what the reduction itself takes. Every clock starts at the
same value, so the ranks' clocks agree after each collective, and what a rank waited is exactly
how much later the slowest rank arrived.
"""

import torch
import torch.distributed as dist

from harness.clock import FakeClock

REDUCE_S = 0.001
"""What a recorded collective itself takes, after the last rank arrived."""


def all_arrive(clock: FakeClock, group=None) -> None:
    """A collective on the recorded timeline (see the module docstring)."""
    arrival = torch.tensor([clock.now], dtype=torch.float64)
    dist.all_reduce(arrival, op=dist.ReduceOp.MAX, group=group)
    clock.advance(arrival.item() - clock.now)  # exactly the last arrival (b - a + a == b for close floats)
    clock.advance(REDUCE_S)
