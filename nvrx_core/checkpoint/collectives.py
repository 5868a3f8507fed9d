"""The few small collectives checkpointing needs, on CPU (gloo) or device (nccl) tensors.

A view of nvrx_core.collectives (which picks the device from the group's backend and runs
the reductions) with checkpointing's conventions: an explicit group argument, None meaning
a single process. All payloads are integers or JSON: nothing is unpickled from another rank.

Every tensor handed to torch.distributed here is created here, owns its memory, and is let
go of only once the backend has let go of it (wait_released). The reason: gloo runs a
collective on a worker thread of its own, which may still hold a reference to the tensors
for a while after the caller's wait() has returned. If the caller's Python tensor object
goes first, torch keeps it alive on behalf of the C++ tensor, and the gloo thread then
has to take the GIL to drop it. When that thread was descheduled long enough for the
interpreter to start exiting (a loaded node, the process group still alive at exit),
taking the GIL ends the thread with pthread_exit, whose unwinding through a noexcept
destructor calls std::terminate: "terminate called without an active exception", exit
code -6, after the job had finished.
"""

import datetime
import json
import logging
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nvrx_core import collectives as _coll


logger = logging.getLogger("nvrx.checkpoint")

USE_DEFAULT_GROUP = _coll.WORLD_IF_INITIALIZED
"""Default for a `process_group` argument: the world group if torch.distributed is
initialized, else no group (pass None explicitly to force single-process behaviour)."""

RELEASE_TIMEOUT_S = 10.0
"""How long wait_released waits for the backend to drop its references."""

_kept: List[torch.Tensor] = []
"""Tensors the backend still held after RELEASE_TIMEOUT_S: kept until the process exits,
so the backend's thread can never be the one that drops their Python objects."""


def resolve_group(process_group: Any) -> Optional[dist.ProcessGroup]:
    return default_group() if process_group is USE_DEFAULT_GROUP else process_group


def group_rank_size(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def default_group() -> Optional[dist.ProcessGroup]:
    """The world group when torch.distributed is initialized, else None (single process)."""
    return _coll.resolve_group(_coll.WORLD_IF_INITIALIZED)


def side_group(group: Optional[dist.ProcessGroup],
               timeout: Optional[datetime.timedelta] = None) -> Optional[dist.ProcessGroup]:
    """A gloo group with the same ranks as `group`, for a background thread's collectives
    (they must never interleave with the training thread's on one group). Collective for
    the members only."""
    if group is None:
        return None
    return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                          timeout=timeout, use_local_synchronization=True)


def wait_released(tensors: Sequence[torch.Tensor], timeout: float = RELEASE_TIMEOUT_S) -> None:
    """Return once torch.distributed holds no reference to any of `tensors`.

    Call it after the operations on them have completed (wait() returned, and the work
    objects dropped), while the caller holds its own references. Those are then the last
    ones, so the tensors are freed by the caller's thread. A tensor the backend still holds
    after `timeout` seconds (not seen with gloo; a thread descheduled that long) is kept
    until the process exits instead.
    """
    use_count = getattr(torch.Tensor, "_use_count", None)
    if use_count is None:       # this torch cannot tell: never let the backend have the last word
        _kept.extend(tensors)
        return
    deadline = time.monotonic() + timeout
    pause = 0.0
    while True:
        held = [t for t in tensors if use_count(t) > 1]
        if not held:
            return
        if time.monotonic() >= deadline:
            logger.warning("torch.distributed still holds %d tensor(s) %.0f s after the "
                           "operation completed; keeping them until the process exits",
                           len(held), timeout)
            _kept.extend(held)
            return
        time.sleep(pause)       # the backend thread needs the CPU, not the GIL
        pause = min(max(2 * pause, 1e-4), 0.01)


def all_reduce_max(values: Sequence[int], group: Optional[dist.ProcessGroup]) -> List[int]:
    """Element-wise max over ranks (min is max of negated values)."""
    values = [int(v) for v in values]
    coll = _coll.Collectives(group)
    if coll.alone or not values:
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=coll.device)
    coll.all_reduce_max_(tensor)
    result = tensor.tolist()
    wait_released([tensor])
    return result


def all_gather_json(obj: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    """Every rank's JSON-serialisable `obj`, in rank order.

    Each rank fills its own row of a (world, longest payload) byte matrix and a max
    all_reduce fills in the others: the same bytes as an all_gather, on tensors owned here
    (see wait_released). The payloads are small (step lists, inventories).
    """
    payload = json.dumps(obj, separators=(",", ":")).encode()
    coll = _coll.Collectives(group)
    if coll.alone:
        return [json.loads(payload)]
    lengths = torch.zeros(coll.world_size, dtype=torch.int64, device=coll.device)
    lengths[coll.rank] = len(payload)
    coll.all_reduce_max_(lengths)
    sizes = lengths.tolist()
    rows = torch.zeros(coll.world_size, max(sizes), dtype=torch.uint8, device=coll.device)
    rows[coll.rank, :len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    coll.all_reduce_max_(rows)
    host = rows.cpu()
    gathered = [json.loads(bytes(host[r, :size].tolist())) for r, size in enumerate(sizes)]
    wait_released([lengths, rows])
    return gathered
