"""GPU and NVLink health from NVML.

GPUHealthCheck, per device:
- the driver's recovery action field (r570+ drivers: none / reset / reboot / drain ...);
- pending page retirement (pre-Ampere) and pending or failed row remapping (Ampere+):
  both need a GPU reset before the memory can be trusted;
- uncorrected (volatile) ECC errors above a threshold;
- hardware clock slowdowns (HW slowdown, HW thermal, power brake): the GPU protects
  itself, and the job runs at a fraction of its speed.
Items a GPU or driver does not support are skipped (noted in the detail).

NVLHealthCheck: every NVLink the device has must be up.
"""

from typing import Any, Callable, Iterable, List, Optional, Sequence, Union

from nvrx_core import dist_env
from nvrx_core.health.nvml import NvmlSession, NvmlUnavailable, is_not_supported, process_nvml
from nvrx_core.health.result import HealthResult, Status

Devices = Union[None, int, str, Sequence[int]]
"""None: every GPU; an int or a list: CUDA device indices; "local": this rank's (LOCAL_RANK)."""

# Clock event reasons that mean the hardware is protecting itself (pynvml's names, bit values).
FATAL_THROTTLE_REASONS = {
    "hw_slowdown": ("nvmlClocksEventReasonHwSlowdown", 0x8),
    "hw_thermal_slowdown": ("nvmlClocksEventReasonHwThermalSlowdown", 0x40),
    "hw_power_brake_slowdown": ("nvmlClocksEventReasonHwPowerBrakeSlowdown", 0x80),
}


def resolve_devices(devices: Devices) -> Optional[List[int]]:
    if devices is None:
        return None
    if devices == "local":
        return [dist_env.local_rank()]
    if isinstance(devices, int):
        return [devices]
    if isinstance(devices, str):
        raise ValueError(f"devices={devices!r}: expected None, 'local', an index or a list of indices")
    return [int(d) for d in devices]


class _NvmlCheck:
    """Shared plumbing: NVML session, device selection, per-device results combined."""

    name = "nvml"

    def __init__(self, devices: Devices = None, nvml: Optional[NvmlSession] = None):
        self.devices = resolve_devices(devices)
        self.nvml = nvml

    def __call__(self) -> HealthResult:
        session = self.nvml or process_nvml()
        try:
            handles = session.device_handles(self.devices)
            module = session.get()
        except NvmlUnavailable as e:
            return HealthResult(self.name, Status.NOT_APPLICABLE, str(e))
        except Exception as e:  # NVMLError while enumerating: the driver is in trouble
            return HealthResult(self.name, Status.UNHEALTHY, f"cannot enumerate GPUs: {e}")
        if not handles:
            return HealthResult(self.name, Status.NOT_APPLICABLE, "no GPU")
        return HealthResult.combine(self.name, (self.check_handle(module, i, h) for i, h in handles),
                                    device=self.devices[0] if self.devices and len(self.devices) == 1 else None)

    def check_handle(self, nvml: Any, index: int, handle: Any) -> HealthResult:
        raise NotImplementedError


class GPUHealthCheck(_NvmlCheck):
    name = "gpu"

    def __init__(self, devices: Devices = None, nvml: Optional[NvmlSession] = None, max_uncorrected_ecc: int = 0,
                 fatal_throttle_reasons: Iterable[str] = tuple(FATAL_THROTTLE_REASONS)):
        super().__init__(devices, nvml)
        unknown = set(fatal_throttle_reasons) - set(FATAL_THROTTLE_REASONS)
        if unknown:
            raise ValueError(f"fatal_throttle_reasons: unknown {sorted(unknown)}; known {sorted(FATAL_THROTTLE_REASONS)}")
        self.max_uncorrected_ecc = max_uncorrected_ecc
        self.fatal_throttle_reasons = tuple(fatal_throttle_reasons)

    def check_handle(self, nvml: Any, index: int, handle: Any) -> HealthResult:
        problems: List[str] = []
        skipped: List[str] = []
        for label, probe in (("recovery action", self._recovery_action), ("retired pages", self._retired_pages),
                             ("row remapping", self._remapped_rows), ("uncorrected ECC", self._ecc),
                             ("clock slowdown", self._throttle)):
            try:
                problem = probe(nvml, handle)
            except Exception as e:
                if is_not_supported(nvml, e):
                    skipped.append(label)
                    continue
                problem = f"{label}: NVML error {e}"
            if problem:
                problems.append(problem)
        detail = "; ".join(problems) if problems else "ok"
        if skipped:
            detail += f" (not supported: {', '.join(skipped)})"
        return HealthResult(f"gpu{index}", Status.UNHEALTHY if problems else Status.HEALTHY, detail, index)

    @staticmethod
    def _recovery_action(nvml: Any, handle: Any) -> Optional[str]:
        field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            raise _unsupported(nvml)
        value = nvml.nvmlDeviceGetFieldValues(handle, [field])[0]
        if value.nvmlReturn != getattr(nvml, "NVML_SUCCESS", 0):
            raise _unsupported(nvml)  # older driver: the field exists in pynvml but not in the driver
        action = value.value.uiVal
        if action == getattr(nvml, "NVML_GPU_RECOVERY_ACTION_NONE", 0):
            return None
        return f"driver asks for recovery action {_constant_name(nvml, 'NVML_GPU_RECOVERY_ACTION_', action)}"

    @staticmethod
    def _retired_pages(nvml: Any, handle: Any) -> Optional[str]:
        if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == nvml.NVML_FEATURE_ENABLED:
            return "page retirement pending (reset the GPU)"
        return None

    @staticmethod
    def _remapped_rows(nvml: Any, handle: Any) -> Optional[str]:
        _corrected, _uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
        if failed:
            return "row remapping failed (the GPU needs service)"
        if pending:
            return "row remapping pending (reset the GPU)"
        return None

    def _ecc(self, nvml: Any, handle: Any) -> Optional[str]:
        count = nvml.nvmlDeviceGetTotalEccErrors(handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
        if count > self.max_uncorrected_ecc:
            return f"{count} uncorrected ECC errors (max {self.max_uncorrected_ecc})"
        return None

    def _throttle(self, nvml: Any, handle: Any) -> Optional[str]:
        query = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        reasons = query(handle)
        active = [name for name in self.fatal_throttle_reasons
                  if reasons & getattr(nvml, FATAL_THROTTLE_REASONS[name][0], FATAL_THROTTLE_REASONS[name][1])]
        return f"clocks slowed down by the hardware: {', '.join(active)}" if active else None


class NVLHealthCheck(_NvmlCheck):
    name = "nvlink"

    def check_handle(self, nvml: Any, index: int, handle: Any) -> HealthResult:
        present, down = 0, []
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(handle, link)
            except Exception as e:
                if is_not_supported(nvml, e):
                    continue  # this device has no such link
                down.append(f"{link} (NVML error {e})")
                present += 1
                continue
            present += 1
            if state != nvml.NVML_FEATURE_ENABLED:
                down.append(str(link))
        if not present:
            return HealthResult(f"nvlink{index}", Status.NOT_APPLICABLE, "no NVLink on this device", index)
        if down:
            return HealthResult(f"nvlink{index}", Status.UNHEALTHY, f"links down: {', '.join(down)} of {present}",
                                index)
        return HealthResult(f"nvlink{index}", Status.HEALTHY, f"{present} links up", index)


def check_device(index: int, nvml: Optional[NvmlSession] = None,
                 cuda_check: Optional[Callable[[], HealthResult]] = None) -> HealthResult:
    """GPU + NVLink checks (and optionally a CUDA check) of one CUDA device, as one result."""
    results = [GPUHealthCheck(index, nvml)(), NVLHealthCheck(index, nvml)()]
    if cuda_check is not None:
        results.append(cuda_check())
    return HealthResult.combine(f"device{index}", results, device=index)


def _unsupported(nvml: Any) -> Exception:
    error_class = getattr(nvml, "NVMLError", None)
    code = getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3)
    return error_class(code) if error_class is not None else NotImplementedError()


def _constant_name(nvml: Any, prefix: str, value: int) -> str:
    for name in dir(nvml):
        if name.startswith(prefix) and getattr(nvml, name) == value:
            return name[len(prefix):].lower()
    return f"unknown ({value})"
