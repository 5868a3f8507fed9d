"""The few collectives the detector needs, on whatever device the process group wants.

Gloo takes CPU tensors, NCCL device tensors: the device is chosen from the group's backend,
so a CPU run never touches torch.cuda. Payloads are JSON (no pickle): each rank's bytes
are padded with spaces to the longest, which JSON parsing ignores.
"""

import json
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist


class LocalCollectives:
    """World of one process (no process group): every collective is the identity."""

    rank = 0
    world_size = 1
    device = torch.device("cpu")

    def max_floats(self, values: Sequence[float]) -> List[float]:
        return list(values)

    def gather_json(self, obj: Any, to_all: bool, size: Optional[int] = None) -> List[Any]:
        return [json.loads(json.dumps(obj))]

    def broadcast_floats(self, values: Optional[Sequence[float]], length: int) -> List[float]:
        return list(values)


class GroupCollectives:
    """Collectives over a torch.distributed process group.

    The torch functions are bound at construction, so a user who times torch.distributed's
    collectives (Detector.wrap_attribute(torch.distributed, "all_reduce", kind="wait"))
    does not also time the detector's own."""

    def __init__(self, group: Any):
        self._all_reduce, self._all_gather = dist.all_reduce, dist.all_gather
        self._gather, self._broadcast = dist.gather, dist.broadcast
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        if "nccl" in str(dist.get_backend(group)).lower():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    def max_floats(self, values: Sequence[float]) -> List[float]:
        """Element-wise max over ranks (negate an entry to get a min)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.tolist()

    def gather_json(self, obj: Any, to_all: bool, size: Optional[int] = None) -> Optional[List[Any]]:
        """Every rank's `obj`, in rank order, on group rank 0 (or on all ranks if `to_all`).

        `size`: a byte count every rank agreed on beforehand that no payload exceeds;
        without it one more collective agrees on the longest payload."""
        data = json.dumps(obj, separators=(",", ":")).encode()
        if size is None:
            (size,) = self.max_floats([len(data)])
        elif len(data) > size:  # the agreed bound is an upper bound by construction
            raise RuntimeError(f"straggler payload of {len(data)} bytes exceeds the agreed bound of {size}")
        padded = torch.full((int(size),), ord(" "), dtype=torch.uint8)
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        padded = padded.to(self.device)
        if to_all:
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            self._all_gather(parts, padded, group=self.group)
        else:
            parts = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
            self._gather(padded, parts, dst=self._root, group=self.group)
            if parts is None:
                return None
        return [json.loads(bytes(p.cpu().untyped_storage())) for p in parts]  # each part owns its storage

    def broadcast_floats(self, values: Optional[Sequence[float]], length: int) -> List[float]:
        """Group rank 0's `values` (length `length`) on every rank."""
        if self.rank == 0:
            tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        else:
            tensor = torch.zeros(length, dtype=torch.float64, device=self.device)
        self._broadcast(tensor, src=self._root, group=self.group)
        return tensor.tolist()


def make_collectives(group: Any):
    """Collectives for `group`; the default group if None and torch.distributed is up."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return LocalCollectives()
        group = dist.group.WORLD
    return GroupCollectives(group)
