"""The few collectives the detector needs, as methods of one small object.

A thin view of nvrx_core.collectives (which picks the device from the group's backend and
sends JSON, never pickles). The detector keeps it as `self._coll`, so a test can wrap one
method (e.g. count the max_floats calls) without touching torch.distributed.
"""

from typing import Any, List, Optional, Sequence

from nvrx_core.collectives import WORLD_IF_INITIALIZED, Collectives


class GroupCollectives:
    """Collectives over a process group, or over nobody (group None: a world of one)."""

    def __init__(self, group: Any):
        self._coll = Collectives(group)
        self.group = self._coll.group
        self.rank = self._coll.rank
        self.world_size = self._coll.world_size
        self.device = self._coll.device

    def max_floats(self, values: Sequence[float]) -> List[float]:
        """Element-wise max over ranks (negate an entry to get a min)."""
        return [float(v) for v in self._coll.all_reduce_max([float(v) for v in values])]

    def gather_json(self, obj: Any, to_all: bool, size: Optional[int] = None) -> Optional[List[Any]]:
        """Every rank's `obj`, in rank order, on group rank 0 (or on all ranks if `to_all`).

        `size`: a byte count every rank agreed on beforehand that no payload exceeds;
        without it one more collective agrees on the longest payload."""
        if to_all:
            return self._coll.all_gather_json(obj, size)
        return self._coll.gather_json(obj, size)

    def broadcast_floats(self, values: Optional[Sequence[float]], length: int) -> List[float]:
        """Group rank 0's `values` (length `length`) on every rank."""
        return self._coll.broadcast_floats(values, length)


def make_collectives(group: Any) -> GroupCollectives:
    """Collectives for `group`; the default group if None and torch.distributed is up."""
    return GroupCollectives(group if group is not None else WORLD_IF_INITIALIZED)
