"""The collectives the rerun protocol needs: one agreed decision per protocol step, and a gather.

Every rank must take the same branch (rerun or not, exit or not), so each decision is a
MAX all-reduce of one integer: the highest-priority outcome any rank saw wins everywhere.
Tensors live on the process group's natural device (CPU for gloo, the current CUDA device
for NCCL). Without an initialized process group the machine runs alone and nothing is sent.
Gathered statistics travel as JSON bytes, not pickles.
"""

import json
import logging
from typing import Any, List, Optional, Union

import torch
import torch.distributed as dist

logger = logging.getLogger("nvrx.rerun")


class CollectiveVote:
    def __init__(self, process_group: Optional[Any] = None, device: Optional[torch.device] = None):
        self._group = process_group
        self._device = device

    @property
    def active(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group) if self.active else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group) if self.active else 1

    @property
    def device(self) -> torch.device:
        """Decided once the process group exists (a machine may be built before init_process_group)."""
        if self._device is not None:
            return self._device
        if not self.active:
            return torch.device("cpu")
        if dist.get_backend(self._group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")
        return self._device

    def max(self, local: Union[int, bool, torch.Tensor]) -> int:
        """The maximum of `local` over all ranks: the only device->host sync of a protocol step.

        `local` may be a device tensor still being computed (e.g. "any check failed"): it is
        reduced where it lives and read back once.
        """
        if isinstance(local, torch.Tensor):
            if not self.active:
                return int(local.item())
            value = local.reshape(()).to(torch.int32)
            if value.device != self.device:
                value = torch.tensor(int(value.item()), dtype=torch.int32, device=self.device)
        else:
            if not self.active:
                return int(local)
            value = torch.tensor(int(local), dtype=torch.int32, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._group)
        return int(value.item())

    def gather_json(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's `obj` (JSON-serialisable) in rank order on rank 0; None on other ranks."""
        payload = json.dumps(obj).encode()
        if not self.active:
            return [json.loads(payload)]
        world = self.world_size
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        lengths = [torch.zeros_like(length) for _ in range(world)]
        dist.all_gather(lengths, length, group=self._group)
        sizes = [int(t.item()) for t in lengths]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        chunks = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(chunks, padded, group=self._group)
        if self.rank != 0:
            return None
        return [json.loads(bytes(c[:n].cpu().tolist())) for c, n in zip(chunks, sizes)]
