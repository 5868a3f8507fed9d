"""Simulated faults, to rehearse recovery before a real GPU dies.

Two ways to trigger, both usable from any training loop:
- time-based (`start()`): a daemon thread waits base_delay (+ random jitter) seconds, like
  Megatron's simulated_fault (fault_type / rank_to_fail / base_delay);
- step-based (`maybe_inject(iteration)` each step): fires at a given iteration, which makes
  runs reproducible (tests, `nvrx demo`).
A fault fires only in restart cycle `cycle` (default 0, the first), otherwise the restarted
job would fail again forever.

Kinds: rank_killed (SIGKILL to itself), rank_hung (the process freezes: SIGSTOP from the
thread, or an endless sleep in the training loop for step-based faults, which leaves a
stack for the monitor to dump), rank_hung_gil (the process spins inside one C call that
holds the GIL, so none of its threads runs: the hang a watchdog thread cannot see),
rank_exception (an exception in the training loop) and random (one of killed / hung, seeded).
"""

import dataclasses
import logging
import os
import random
import re
import signal
import threading
import time
from typing import Any, Mapping, Optional, Union

from nvrx_core import dist_env
from nvrx_core import events as ev
from nvrx_core.config import ConfigError, check

logger = logging.getLogger("nvrx.ft.faults")

FAULT_TYPES = ("rank_killed", "rank_hung", "rank_hung_gil", "rank_exception", "random")
GIL_HELD_SPIN = (r"(a|aa)+$", "a" * 80 + "b")
"""A regular expression that backtracks for longer than any job runs, inside one C call."""


class SimulatedFaultError(RuntimeError):
    """Raised by a rank_exception fault."""


@dataclasses.dataclass
class SimulatedFault:
    fault_type: str
    rank_to_fail: Optional[int] = None
    """Global rank that fails; None picks one at random (seeded) from the world."""
    base_delay: Optional[float] = None
    """Seconds after start() before the fault fires (time-based)."""
    jitter: float = 0.0
    """Extra uniform random delay in [0, jitter) seconds added to base_delay."""
    at_iteration: Optional[int] = None
    """Iteration at which maybe_inject() fires (step-based)."""
    cycle: int = 0
    """Restart cycle (TORCHELASTIC_RESTART_COUNT) in which the fault fires."""
    seed: int = 0

    def __post_init__(self):
        check(self.fault_type in FAULT_TYPES, "fault_type", self.fault_type, f"must be one of {FAULT_TYPES}")
        check((self.base_delay is None) != (self.at_iteration is None), "base_delay/at_iteration",
              (self.base_delay, self.at_iteration), "set exactly one of them")
        if self.base_delay is not None:
            check(self.base_delay >= 0, "base_delay", self.base_delay, "must be >= 0 seconds")
            check(self.fault_type != "rank_exception", "fault_type", self.fault_type,
                  "an exception can only be raised in the training loop: use at_iteration")
        check(self.jitter >= 0, "jitter", self.jitter, "must be >= 0 seconds")
        if self.at_iteration is not None:
            check(self.at_iteration >= 0, "at_iteration", self.at_iteration, "must be >= 0")
        if self.rank_to_fail is not None:
            check(self.rank_to_fail >= 0, "rank_to_fail", self.rank_to_fail, "must be >= 0")


class FaultInjector:
    """Fires one SimulatedFault in the targeted rank of the targeted cycle."""

    def __init__(self, fault: SimulatedFault, rank: Optional[int] = None, world_size: Optional[int] = None,
                 cycle: Optional[int] = None):
        self.fault = fault
        self.rank = rank if rank is not None else dist_env.rank()
        world = world_size if world_size is not None else dist_env.world_size()
        self.cycle = cycle if cycle is not None else dist_env.restart_count()
        rng = random.Random(fault.seed)
        self.target_rank = fault.rank_to_fail if fault.rank_to_fail is not None else rng.randrange(world)
        self.kind = fault.fault_type
        if self.kind == "random":
            self.kind = rng.choice(("rank_killed", "rank_hung"))
        self.delay = (fault.base_delay or 0.0) + rng.uniform(0, fault.jitter)
        self.armed = self.rank == self.target_rank and self.cycle == fault.cycle
        self._events = ev.EventLog.from_env(source="faults")

    def start(self) -> None:
        """Time-based: arm a daemon thread that fires after the delay."""
        if self.armed and self.fault.base_delay is not None:
            threading.Thread(target=self._fire_later, name="nvrx-simulated-fault", daemon=True).start()

    def maybe_inject(self, iteration: int) -> None:
        """Step-based: call once per iteration; fires in the main thread at at_iteration."""
        if self.armed and self.fault.at_iteration is not None and iteration == self.fault.at_iteration:
            self._fire(in_main_thread=True, iteration=iteration)

    def _fire_later(self) -> None:
        time.sleep(self.delay)
        self._fire(in_main_thread=False, iteration=None)

    def _fire(self, in_main_thread: bool, iteration: Optional[int]) -> None:
        self.armed = False
        logger.warning("simulated fault %s in rank %d (iteration %s)", self.kind, self.rank, iteration)
        self._events.emit(ev.FAULT_INJECTED, fault=self.kind, iteration=iteration)
        if self.kind == "rank_killed":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "rank_hung":
            if in_main_thread:
                while True:  # a hang with a Python stack the monitor can dump
                    time.sleep(3600)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "rank_hung_gil":
            re.match(*GIL_HELD_SPIN)
        else:
            raise SimulatedFaultError(f"simulated fault in rank {self.rank} at iteration {iteration}")


def simulated_fault_from(value: Union[SimulatedFault, Mapping[str, Any], None]) -> Optional[SimulatedFault]:
    """An adapter's `simulated_fault` argument (a SimulatedFault, a dict of its fields, or None),
    checked where it is given: an unknown or bad field is named with the argument's name."""
    if value is None or isinstance(value, SimulatedFault):
        return value
    check(isinstance(value, Mapping), "simulated_fault", value, "must be a SimulatedFault, a dict of its fields or None")
    known = {f.name for f in dataclasses.fields(SimulatedFault)}
    unknown = sorted(set(value) - known)
    check(not unknown, "simulated_fault", unknown, f"unknown fields; known: {sorted(known)}")
    try:
        return SimulatedFault(**value)
    except ConfigError as e:
        raise ConfigError(f"simulated_fault: {e}") from None
