"""The few small collectives checkpointing needs, on CPU (gloo) or device (nccl) tensors.

All payloads are integers or JSON: nothing is unpickled from another rank.
"""

import datetime
import json
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


USE_DEFAULT_GROUP = object()
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
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def side_group(group: Optional[dist.ProcessGroup],
               timeout: Optional[datetime.timedelta] = None) -> Optional[dist.ProcessGroup]:
    """A gloo group with the same ranks as `group`, for a background thread's collectives
    (they must never interleave with the training thread's on one group). Collective for
    the members only."""
    if group is None:
        return None
    return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                          timeout=timeout, use_local_synchronization=True)


def _device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(values: Sequence[int], group: Optional[dist.ProcessGroup]) -> List[int]:
    """Element-wise max over ranks (min is max of negated values)."""
    if group is None:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.int64, device=_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def all_gather_json(obj: Any, group: Optional[dist.ProcessGroup]) -> List[Any]:
    """Every rank's JSON-serialisable `obj`, in rank order."""
    if group is None:
        return [obj]
    device = _device(group)
    payload = json.dumps(obj, sort_keys=True).encode()
    _, world = group_rank_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [json.loads(bytes(t[: int(s.item())].cpu().tolist())) for t, s in zip(gathered, sizes)]
