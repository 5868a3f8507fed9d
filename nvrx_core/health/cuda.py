"""CUDA health: a device synchronize that must finish in time.

A device with a sticky error (illegal address, ECC, Xid) fails every synchronize; one
with a wedged kernel never returns. The synchronize runs in a helper thread, so a hang
becomes an "unhealthy" answer after `timeout` seconds instead of hanging the caller.
On a CPU-only build or machine the check is "not applicable" (and no torch.cuda call is
made on a CPU build).
"""

import threading
from typing import Optional, Union

import torch

from nvrx_core.health.gpu import resolve_devices
from nvrx_core.health.result import HealthResult, Status


class CudaHealthCheck:
    name = "cuda"

    def __init__(self, timeout: float = 30.0, device: Union[None, int, str] = None):
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}: must be > 0 seconds")
        self.timeout = timeout
        devices = resolve_devices(device)
        self.device: Optional[int] = devices[0] if devices else None

    def __call__(self) -> HealthResult:
        if torch.version.cuda is None:
            return HealthResult(self.name, Status.NOT_APPLICABLE, "torch is a CPU-only build")
        if not torch.cuda.is_available():
            return HealthResult(self.name, Status.NOT_APPLICABLE, "no CUDA device")
        outcome: dict = {}

        def synchronize() -> None:
            try:
                torch.cuda.synchronize(self.device)
                outcome["ok"] = True
            except Exception as e:  # a sticky CUDA error surfaces here
                outcome["error"] = e

        worker = threading.Thread(target=synchronize, name="nvrx-cuda-health", daemon=True)
        worker.start()
        worker.join(self.timeout)
        device = self.device if self.device is not None else torch.cuda.current_device()
        if worker.is_alive():
            return HealthResult(self.name, Status.UNHEALTHY,
                                f"synchronize did not return within {self.timeout} s", device)
        if "error" in outcome:
            return HealthResult(self.name, Status.UNHEALTHY, f"synchronize failed: {outcome['error']}", device)
        return HealthResult(self.name, Status.HEALTHY, "synchronize ok", device)
