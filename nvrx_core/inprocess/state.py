"""The object the wrapped function receives: which restart iteration, which rank, which store."""

import contextlib
import dataclasses
import datetime
from typing import Any, ContextManager, FrozenSet, Optional, Tuple

import torch.distributed as dist

from nvrx_core.collectives import is_nccl
from nvrx_core.inprocess.records import InterruptionRecord


@dataclasses.dataclass(frozen=True)
class RestartState:
    """What the wrapped function needs to (re)start.

    Iteration 0 is the first call; iteration k > 0 follows k faults, so the function can
    resume from an in-memory copy or a checkpoint instead of starting over. `store` is a
    fresh, empty namespace of the coordination store for this iteration: build the
    process group on it (state.init_process_group does) so a restarted group never reads
    the keys of the previous one.
    """

    iteration: int
    rank: int
    """Active rank in this iteration (may differ from initial_rank after reassignment)."""
    world_size: int
    initial_rank: int
    initial_world_size: int
    local_rank: int
    store: Any = dataclasses.field(repr=False)
    store_prefix: str = ""
    previous_interruptions: Tuple[InterruptionRecord, ...] = ()
    """What ended the previous iteration (empty in iteration 0)."""
    terminated_ranks: FrozenSet[int] = frozenset()
    """Initial ranks no longer in the job."""
    respawned: FrozenSet[int] = frozenset()
    """Active ranks whose processes are new in this iteration (ft_launcher's replacements of dead
    ranks, under --ft-restart-policy respawn-rank): they hold none of the job's state yet, which
    `nvrx_core.inprocess.roll_forward` brings them from a rank that kept its memory."""
    _atomic: Any = dataclasses.field(default=None, repr=False, compare=False)
    _group_created: Any = dataclasses.field(default=None, repr=False, compare=False)
    _gloo_timeout: Optional[float] = dataclasses.field(default=None, repr=False, compare=False)

    def init_process_group(self, backend: str = "gloo", timeout: Optional[datetime.timedelta] = None,
                           **kwargs) -> None:
        """torch.distributed.init_process_group on this iteration's store, rank and world size.

        A gloo group gets a timeout between the Wrapper's soft and hard timeouts unless one is
        given: a receive that gloo posted on a connection the abort had already closed never
        fails (torch 2.13), so without it a rank that reached a collective late stays blocked
        until the hard timeout kills it. A collective longer than soft_timeout is interrupted
        anyway, and the soft timeout, coming first, still names the rank that stopped.
        """
        if timeout is None and self._gloo_timeout is not None and "gloo" in backend and not is_nccl(backend):
            timeout = datetime.timedelta(seconds=self._gloo_timeout)
        if timeout is not None:
            kwargs["timeout"] = timeout
        dist.init_process_group(backend, store=self.store, rank=self.rank, world_size=self.world_size, **kwargs)
        if self._group_created is not None:
            self._group_created()

    def atomic(self) -> ContextManager[None]:
        """A block that a restart does not interrupt midway (e.g. writing a checkpoint)."""
        return self._atomic() if self._atomic is not None else contextlib.nullcontext()
