"""The few small collectives checkpointing needs, on CPU (gloo) or device (nccl) tensors.

A view of nvrx_core.collectives (which picks the device from the group's backend, runs the
collectives, and lets go of a tensor only after the backend has: see its docstring) with
checkpointing's conventions: an explicit group argument, None meaning a single process.
All payloads are integers or JSON: nothing is unpickled from another rank.
"""

import datetime
from typing import Any, List, Optional, Sequence, Tuple

import torch.distributed as dist

from nvrx_core import collectives as _coll


USE_DEFAULT_GROUP = _coll.WORLD_IF_INITIALIZED
"""Default for a `process_group` argument: the world group if torch.distributed is
initialized, else no group (pass None explicitly to force single-process behaviour)."""


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


def all_reduce_max(values: Sequence[int], group: Optional[dist.ProcessGroup]) -> List[int]:
    """Element-wise max over ranks (min is max of negated values)."""
    return _coll.Collectives(group).all_reduce_max([int(v) for v in values])


def all_gather_json(obj: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    """Every rank's JSON-serialisable `obj`, in rank order."""
    return _coll.Collectives(group).all_gather_json(obj)
