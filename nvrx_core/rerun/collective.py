"""The collectives the rerun protocol needs: one agreed decision per protocol step, and a gather.

Every rank must take the same branch (rerun or not, exit or not), so each decision is a
MAX all-reduce of one integer: the highest-priority outcome any rank saw wins everywhere.
The device and the wire format come from nvrx_core.collectives (CPU for gloo, the current
CUDA device for NCCL; JSON, not pickles), and so does the meaning of the group: None is the
default group, and without an initialized process group the machine runs alone and nothing is
sent.
"""

import logging
from typing import Any, List, Optional, Union

import torch

from nvrx_core.collectives import Collectives, is_distributed

logger = logging.getLogger("nvrx.rerun")


class CollectiveVote:
    """The machine's agreements over `process_group` (None: the default group)."""

    def __init__(self, process_group: Optional[Any] = None, device: Optional[torch.device] = None):
        self._group = process_group
        self._device = device
        self._coll: Optional[Collectives] = None

    @property
    def active(self) -> bool:
        return is_distributed()

    def _collectives(self) -> Collectives:
        """Built once the process group exists (a machine may be built before init_process_group,
        and the default group is the one found then); until then a world of one."""
        if not self.active:
            return Collectives(None, self._device)
        if self._coll is None:
            self._coll = Collectives(self._group, self._device)
        return self._coll

    @property
    def rank(self) -> int:
        return self._collectives().rank

    @property
    def world_size(self) -> int:
        return self._collectives().world_size

    @property
    def device(self) -> torch.device:
        return self._collectives().device

    def max(self, local: Union[int, bool, torch.Tensor]) -> int:
        """The maximum of `local` over all ranks: the only device->host sync of a protocol step.

        `local` may be a device tensor still being computed (e.g. "any check failed"): it is
        reduced where it lives and read back once.
        """
        coll = self._collectives()
        if coll.alone:
            return int(local.item()) if isinstance(local, torch.Tensor) else int(local)
        if isinstance(local, torch.Tensor):
            value = local.reshape(()).to(torch.int32)
            if value.device != coll.device:
                value = torch.tensor(int(value.item()), dtype=torch.int32, device=coll.device)
        else:
            value = torch.tensor(int(local), dtype=torch.int32, device=coll.device)
        return int(coll.all_reduce_max_(value).item())

    def gather_json(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's `obj` (JSON-serialisable) in rank order on rank 0; None on other ranks."""
        return self._collectives().gather_json(obj)
