"""The one collectives helper: small agreements between ranks, on the right device.

Every part of the core needs a few tiny collectives (a max over ranks, every rank's JSON
report, rank 0's decision). They used to decide the tensor device each in their own way;
here it is decided once, from the process group's backend:

- a backend that includes NCCL takes tensors on the current CUDA device;
- gloo (and any other backend) takes CPU tensors, and that path never calls torch.cuda,
  so a CPU-only run works where CUDA is absent or broken.

A `group` argument means what it means to torch.distributed: None is the default (world)
group. Without torch.distributed initialised, None is a world of one: every collective is the
identity and nothing is sent, so code written for N ranks runs unchanged in a single process.
A caller that wants this process alone while a process group exists says so with
SINGLE_PROCESS (e.g. a checkpointer built before init_process_group keeps its background
collectives off a group created later). A group of one rank also sends nothing.

Payloads cross ranks as raw bytes or JSON, never as pickles: unpickling bytes another
process produced would run whatever code that process asked for.

The torch functions are called through torch.distributed.distributed_c10d, not through
the torch.distributed namespace: a user who wraps torch.distributed.all_reduce to time
their own collectives (the straggler detector's wrap_attribute) must not also time ours.

Every CPU tensor handed to torch.distributed here is created here, owns its memory (never a
Python buffer's), and is let go of only once the backend has let go of it (wait_released).
The reason: gloo runs a collective on a worker thread of its own, which may still hold a
reference to the tensors for a while after the caller's wait() returned. If the caller's
Python tensor object goes first, torch keeps it alive on behalf of the C++ tensor, and the
gloo thread then has to take the GIL to drop it. When that thread was descheduled long
enough for the interpreter to start exiting (a loaded node, the process group still alive
at exit), taking the GIL ends the thread with pthread_exit, whose unwinding through a
noexcept destructor calls std::terminate: "terminate called without an active exception",
exit code -6, after the job had finished. NCCL's references are dropped by its watchdog
thread on a schedule of its own (every ~100 ms); waiting for them would stall every step,
so device tensors are not waited on.
"""

import json
import logging
import struct
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from nvrx_core import teardown, torch_compat

logger = logging.getLogger("nvrx.collectives")


class _SingleProcess:
    """The type of SINGLE_PROCESS (one instance; pickles as the module's constant)."""

    def __repr__(self) -> str:
        return "nvrx_core.collectives.SINGLE_PROCESS"

    def __reduce__(self) -> str:
        return "SINGLE_PROCESS"


SINGLE_PROCESS = _SingleProcess()
"""A `group` argument meaning this process alone, whether or not a process group exists:
rank 0 of a world of one, every collective the identity."""

_HEADER = struct.Struct("<Q")  # payload length in front of each padded buffer

RELEASE_TIMEOUT_S = 10.0
"""How long wait_released waits for the backend to drop its references."""

def wait_released(tensors: Sequence[torch.Tensor], timeout: Optional[float] = None) -> None:
    """Return once torch.distributed holds no reference to any of `tensors`.

    Call it after the operations on them completed (wait() returned, the work objects
    dropped), while the caller holds its own references: those are then the last ones, so
    the tensors are freed on the caller's thread (see the module docstring). A tensor the
    backend still holds after `timeout` seconds is kept until the process exits instead
    (teardown.keep_until_exit; never seen with gloo: it takes a thread descheduled that long).
    `timeout` None: RELEASE_TIMEOUT_S, read at the call.
    """
    timeout = RELEASE_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + timeout
    pause = 0.0
    while True:
        held = [t for t in tensors if torch_compat.tensor_use_count(t) > 1]
        if not held:
            return
        if time.monotonic() >= deadline:
            logger.warning("torch.distributed still holds %d tensor(s) %.0f s after the operation "
                           "completed; keeping them until the process exits", len(held), timeout)
            teardown.keep_until_exit(held)
            return
        time.sleep(pause)       # the backend's thread needs the CPU, not the GIL
        pause = min(max(2 * pause, 1e-4), 0.01)


def is_distributed() -> bool:
    """Whether torch.distributed is built in and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def resolve_group(group: Any = None) -> Any:
    """The group a collective runs on, decided now: None is the world group when
    torch.distributed is initialised, else SINGLE_PROCESS; any other value is itself. An
    object that keeps a group for later calls resolves it once, when it is built, so what
    it talks to does not change under it when a process group appears afterwards."""
    if group is None:
        return dist.group.WORLD if is_distributed() else SINGLE_PROCESS
    return group


def group_rank_size(group: Any = None) -> Tuple[int, int]:
    """(this process's rank in `group`, the group's size); (0, 1) for a world of one."""
    group = resolve_group(group)
    if group is SINGLE_PROCESS:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def is_nccl(group: Any) -> bool:
    """Whether NCCL carries collectives of `group`: a process group (None: the default one), or a
    backend name as init_process_group takes it ("nccl", "cpu:gloo,cuda:nccl", "gloo")."""
    if group is SINGLE_PROCESS:
        return False
    backend = group if isinstance(group, str) else dist.get_backend(group)
    return "nccl" in str(backend).lower()


def group_device(group: Any = None) -> torch.device:
    """The device a collective on `group` takes tensors on (see the module docstring)."""
    group = resolve_group(group)
    if group is SINGLE_PROCESS:
        return torch.device("cpu")
    if is_nccl(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Collectives:
    """Collectives over one process group: None is the default group (a world of one without
    torch.distributed), SINGLE_PROCESS this process alone. The group is resolved when the
    object is built (resolve_group).

    `device` overrides the backend's choice (a caller who already holds tensors on a
    device the backend accepts)."""

    def __init__(self, group: Any = None, device: Optional[torch.device] = None):
        self.group = resolve_group(group)
        if self.group is SINGLE_PROCESS:
            self.rank, self.world_size, self._root = 0, 1, 0
        else:
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self._root = 0 if self.group is dist.group.WORLD else dist.get_global_rank(self.group, 0)
        self.device = device if device is not None else group_device(self.group)

    @property
    def alone(self) -> bool:
        """True when there is nobody to talk to: collectives return local copies."""
        return self.world_size == 1

    def _released(self, *tensors: torch.Tensor) -> None:
        """After a blocking collective on CPU tensors: wait until the backend let go of them."""
        if self.device.type == "cpu":
            wait_released(tensors)

    # ---- numbers -------------------------------------------------------------------
    def all_reduce_max(self, values: Sequence[Any]) -> List[Any]:
        """Element-wise max over ranks (a min is the max of negated values).

        Integers (and bools) travel as int64, so large ids survive exactly; if any value
        is a float, all travel as float64."""
        values = list(values)
        if self.alone or not values:
            return values
        floating = any(isinstance(v, float) for v in values)
        tensor = torch.tensor(values, dtype=torch.float64 if floating else torch.int64, device=self.device)
        _c10d.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        result = tensor.tolist()
        self._released(tensor)
        return result

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place max over ranks of a tensor already on self.device (e.g. a flag still
        being computed on the GPU: reduced where it lives, no host sync here). A CPU tensor
        must own its memory (not torch.frombuffer's) and the caller should not hold views of
        it: on return the backend has let go of it."""
        if not self.alone:
            _c10d.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
            self._released(tensor)
        return tensor

    def broadcast_floats(self, values: Optional[Sequence[float]], length: int) -> List[float]:
        """Group rank 0's `values` (exactly `length` floats) on every rank; others pass None."""
        if self.alone:
            return [float(v) for v in values]
        if self.rank == 0:
            if len(values) != length:
                raise ValueError(f"broadcast_floats: {len(values)} values, expected {length}")
            tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        else:
            tensor = torch.zeros(length, dtype=torch.float64, device=self.device)
        _c10d.broadcast(tensor, src=self._root, group=self.group)
        result = tensor.tolist()
        self._released(tensor)
        return result

    # ---- bytes ---------------------------------------------------------------------
    def _agreed_size(self, data: bytes, max_size: Optional[int]) -> int:
        if max_size is None:
            return int(self.all_reduce_max([len(data)])[0])
        if len(data) > max_size:
            raise ValueError(f"payload of {len(data)} bytes exceeds the agreed bound of {max_size}")
        return int(max_size)

    def _framed(self, data: bytes, size: int) -> torch.Tensor:
        buffer = bytearray(_HEADER.size + size)
        _HEADER.pack_into(buffer, 0, len(data))
        buffer[_HEADER.size:_HEADER.size + len(data)] = data
        # a copy in memory torch owns: the backend may drop the last reference (see wait_released)
        return torch.frombuffer(buffer, dtype=torch.uint8).to(self.device, copy=True)

    @staticmethod
    def _unframed(tensor: torch.Tensor) -> bytes:
        raw = tensor.cpu().contiguous()
        start = raw.storage_offset()
        storage = bytes(raw.untyped_storage())[start:start + raw.numel()]
        (length,) = _HEADER.unpack_from(storage, 0)
        return storage[_HEADER.size:_HEADER.size + length]

    def all_gather_bytes(self, data: bytes, max_size: Optional[int] = None) -> List[bytes]:
        """Every rank's `data`, in group rank order, on every rank.

        `max_size`: a bound every rank agreed on beforehand (saves one collective);
        without it the ranks first agree on the longest payload."""
        if self.alone:
            return [bytes(data)]
        mine = self._framed(data, self._agreed_size(data, max_size))
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        _c10d.all_gather(parts, mine, group=self.group)
        result = [self._unframed(p) for p in parts]
        self._released(mine, *parts)
        return result

    def gather_bytes(self, data: bytes, max_size: Optional[int] = None) -> Optional[List[bytes]]:
        """Every rank's `data` in group rank order on group rank 0; None on the others."""
        if self.alone:
            return [bytes(data)]
        mine = self._framed(data, self._agreed_size(data, max_size))
        parts = [torch.empty_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
        _c10d.gather(mine, parts, dst=self._root, group=self.group)
        result = None if parts is None else [self._unframed(p) for p in parts]
        self._released(mine, *(parts or []))
        return result

    def global_rank(self, group_rank: int) -> int:
        """The global rank of this group's rank `group_rank` (torch's src/dst arguments)."""
        if self.group is SINGLE_PROCESS or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def broadcast_bytes(self, data: Optional[bytes], src: int = 0) -> bytes:
        """Group rank `src`'s `data` on every rank (others pass None)."""
        if self.alone:
            return bytes(data)
        root = self.global_rank(src)
        size = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64, device=self.device)
        _c10d.broadcast(size, src=root, group=self.group)
        length = int(size.item())
        self._released(size)
        buffer = self._framed(data if self.rank == src else b"", length)
        _c10d.broadcast(buffer, src=root, group=self.group)
        result = self._unframed(buffer)
        self._released(buffer)
        return result

    # ---- JSON ----------------------------------------------------------------------
    def all_gather_json(self, obj: Any, max_size: Optional[int] = None) -> List[Any]:
        """Every rank's JSON-serialisable `obj`, in group rank order, on every rank."""
        return [json.loads(p) for p in self.all_gather_bytes(_dumps(obj), max_size)]

    def gather_json(self, obj: Any, max_size: Optional[int] = None) -> Optional[List[Any]]:
        """Every rank's `obj` on group rank 0; None on the others."""
        parts = self.gather_bytes(_dumps(obj), max_size)
        return None if parts is None else [json.loads(p) for p in parts]

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        """Group rank `src`'s `obj` on every rank (others pass anything, e.g. None)."""
        return json.loads(self.broadcast_bytes(_dumps(obj) if self.rank == src else None, src))


def _dumps(obj: Any) -> bytes:
    # allow_nan: statistics may hold inf/nan, which Python's json reads back.
    return json.dumps(obj, separators=(",", ":")).encode()


def all_reduce_max(values: Sequence[Any], group: Any = None) -> List[Any]:
    """Element-wise max of `values` over the ranks of `group` (None: the default group); a
    plain copy when torch.distributed is not initialised or the group has one rank."""
    return Collectives(group).all_reduce_max(values)


def all_gather_json(obj: Any, group: Any = None) -> List[Any]:
    """Every rank's JSON-serialisable `obj`, in rank order."""
    return Collectives(group).all_gather_json(obj)


def broadcast_json(obj: Any, group: Any = None) -> Any:
    """Group rank 0's JSON-serialisable `obj` on every rank."""
    return Collectives(group).broadcast_json(obj)
