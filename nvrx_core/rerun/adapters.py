"""Adapters between the rerun machine and the process it runs in: RNG/extra state and device identity.

A rerun must start from exactly the state the first run started from, and the machine
must know which physical device produced a suspicious result so a resumed job can tell
whether it landed somewhere else. Both are adapters so a framework (or a test) can supply
its own: extra state to snapshot, or the identity of a device that cannot exist here.
"""

import dataclasses
import random
import socket
import sys
from typing import Any, Callable, Optional, Protocol

import torch

from nvrx_core import dist_env


class StateAdapter(Protocol):
    """Snapshots state a rerun must restore (the optimizer has not stepped, so not the model).

    Snapshots travel in checkpoints, so `capture` must return plain data: tensors, numbers,
    strings, None, and lists/tuples/dicts of those (loadable with torch.load(weights_only=True)).
    """

    def capture(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...

    def check_snapshot(self, snapshot: Any, field: str) -> None:
        """Raise ValueError naming `field` if `snapshot` (loaded from a checkpoint) is malformed."""


@dataclasses.dataclass
class CallbackStateAdapter:
    """Wraps a pair of functions (Megatron's state_save_func / state_restore_func) as an adapter."""

    save_func: Callable[[], Any]
    restore_func: Callable[[Any], None]
    check_func: Optional[Callable[[Any], None]] = None
    """Raises ValueError for a malformed snapshot; None accepts any."""

    def capture(self) -> Any:
        return self.save_func()

    def restore(self, snapshot: Any) -> None:
        self.restore_func(snapshot)

    def check_snapshot(self, snapshot: Any, field: str) -> None:
        if self.check_func is not None:
            try:
                self.check_func(snapshot)
            except ValueError as e:
                raise ValueError(f"{field}: {e}") from None


class RngStateAdapter:
    """Snapshots every random generator a training step may draw from.

    torch's CPU generator always; the CUDA generator of `device` when that is a CUDA device
    (never touched on a CPU run); Python's `random`; NumPy's global generator when NumPy is
    already imported (importing it here would cost every user that does not use it).
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.device = torch.device("cpu") if device is None else torch.device(device)

    def capture(self) -> dict:
        snapshot = {
            "torch_cpu": torch.get_rng_state(),
            "torch_cuda": None,
            "python": random.getstate(),  # a tuple of ints: plain data
            "numpy": None,
        }
        if self.device.type == "cuda":
            snapshot["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
            snapshot["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
        return snapshot

    def check_snapshot(self, snapshot: Any, field: str) -> None:
        keys = {"torch_cpu", "torch_cuda", "python", "numpy"}
        if not isinstance(snapshot, dict) or set(snapshot) != keys:
            raise ValueError(f"{field}: must be a mapping with keys {sorted(keys)}")
        for name in ("torch_cpu", "torch_cuda"):
            value = snapshot[name]
            if value is None and name == "torch_cuda":
                continue
            if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
                raise ValueError(f"{field}.{name}: must be a uint8 tensor (a torch RNG state)")
        python = snapshot["python"]
        if not (
            isinstance(python, (list, tuple)) and len(python) == 3
            and isinstance(python[1], (list, tuple)) and all(isinstance(v, int) for v in python[1])
        ):
            raise ValueError(f"{field}.python: must be [version, [ints], gauss] from random.getstate()")
        numpy = snapshot["numpy"]
        if numpy is not None and not (isinstance(numpy, (list, tuple)) and len(numpy) == 5):
            raise ValueError(f"{field}.numpy: must be null or the 5 parts of numpy.random.get_state()")

    def restore(self, snapshot: dict) -> None:
        torch.set_rng_state(snapshot["torch_cpu"])
        if snapshot["torch_cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(snapshot["torch_cuda"], self.device)
        version, internal, gauss = snapshot["python"]
        random.setstate((version, tuple(internal), gauss))
        numpy = sys.modules.get("numpy")
        if snapshot["numpy"] is not None and numpy is not None:
            name, keys, pos, has_gauss, cached = snapshot["numpy"]
            numpy.random.set_state((name, keys.numpy().astype(numpy.uint32), pos, has_gauss, cached))


@dataclasses.dataclass(frozen=True)
class DeviceIdentity:
    """The physical device a rank computes on: the GPU UUID if known, else host + device slot."""

    host: str
    device: str
    """e.g. "cuda:3", or "cpu:<local rank>" (one CPU "device" per rank slot on a host)."""
    uuid: Optional[str] = None

    @property
    def key(self) -> str:
        """What two identities are compared by: a GPU UUID survives renumbering of devices."""
        return self.uuid if self.uuid else f"{self.host}/{self.device}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, field: str) -> "DeviceIdentity":
        if not isinstance(data, dict) or set(data) != {"host", "device", "uuid"}:
            raise ValueError(f"{field}={data!r}: must be a mapping with keys host, device, uuid")
        for name in ("host", "device"):
            if not isinstance(data[name], str) or not data[name]:
                raise ValueError(f"{field}.{name}={data[name]!r}: must be a non-empty string")
        if data["uuid"] is not None and not isinstance(data["uuid"], str):
            raise ValueError(f"{field}.uuid={data['uuid']!r}: must be a string or None")
        return cls(**data)

    def __str__(self) -> str:
        where = f"{self.host} {self.device}"
        return f"{where} (uuid {self.uuid})" if self.uuid else where


def local_device_identity(device: torch.device) -> DeviceIdentity:
    """The identity of `device` in this process (the CUDA branch runs only for a CUDA device)."""
    host = socket.gethostname()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        return DeviceIdentity(host, f"cuda:{index}", str(uuid) if uuid is not None else None)
    slot = device.index if device.index is not None else dist_env.local_rank()
    return DeviceIdentity(host, f"{device.type}:{slot}")
