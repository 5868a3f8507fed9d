"""NVML (through nvidia-ml-py's `pynvml`), initialised once per process.

nvmlInit is slow-ish and not meant to be paired with nvmlShutdown around every query, so
one session per process serves every check. After a fork the child initialises its
own (NVML state does not survive fork). Where NVML cannot be used (package missing, no
driver, no GPU) the session says why, once, and checks report "not applicable".
"""

import importlib
import logging
import os
import threading
from typing import Any, Callable, List, Optional

logger = logging.getLogger("nvrx.health")


class NvmlUnavailable(Exception):
    """NVML cannot be used in this process; the message says why."""


class NvmlSession:
    """Lazily initialised NVML. Inject `module` (any object with pynvml's API) to test parsing."""

    def __init__(self, module: Any = None, importer: Callable[[str], Any] = importlib.import_module):
        self._module = module
        self._importer = importer
        self._lock = threading.Lock()
        self._pid: Optional[int] = None
        self._error: Optional[str] = None

    def get(self) -> Any:
        """The initialised pynvml module, or NvmlUnavailable."""
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._error = os.getpid(), None
                self._initialise()
            if self._error is not None:
                raise NvmlUnavailable(self._error)
            return self._module

    def _initialise(self) -> None:
        if self._module is None:
            try:
                self._module = self._importer("pynvml")
            except ImportError:
                self._error = "nvidia-ml-py is not installed (pip install 'nvrx-suite[gpu]')"
                return
        try:
            self._module.nvmlInit()
        except Exception as e:  # pynvml.NVMLError: library not found, driver not loaded, ...
            self._error = f"NVML cannot start: {e}"
            return
        logger.debug("NVML initialised in pid %d", os.getpid())

    def device_handles(self, cuda_indices: Optional[List[int]] = None) -> List[tuple]:
        """[(cuda index, NVML handle)]: all GPUs, or the given CUDA indices mapped through
        CUDA_VISIBLE_DEVICES (NVML numbers GPUs ignoring it)."""
        nvml = self.get()
        if cuda_indices is None:
            visible = _visible_devices()
            count = nvml.nvmlDeviceGetCount()
            cuda_indices = list(range(len(visible) if visible is not None else count))
        return [(i, _handle(nvml, i)) for i in cuda_indices]


def _visible_devices() -> Optional[List[str]]:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def _handle(nvml: Any, cuda_index: int) -> Any:
    visible = _visible_devices()
    if visible is None:
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
    if cuda_index >= len(visible):
        raise NvmlUnavailable(f"CUDA device {cuda_index} is not visible (CUDA_VISIBLE_DEVICES={','.join(visible)})")
    entry = visible[cuda_index]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)


_PROCESS_SESSION: Optional[NvmlSession] = None
_PROCESS_SESSION_LOCK = threading.Lock()


def process_nvml() -> NvmlSession:
    """The process's shared session: NVML is a per-process resource, so this one is shared on purpose."""
    global _PROCESS_SESSION
    with _PROCESS_SESSION_LOCK:
        if _PROCESS_SESSION is None:
            _PROCESS_SESSION = NvmlSession()
        return _PROCESS_SESSION


def is_not_supported(nvml: Any, error: Exception) -> bool:
    """NVML's "this GPU/driver does not have that": a missing feature, not a fault."""
    codes = {getattr(nvml, name, None) for name in
             ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT")}
    return getattr(error, "value", None) in codes - {None}
