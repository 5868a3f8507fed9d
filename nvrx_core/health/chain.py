"""Running several checks as one, for the in-process Wrapper and for ft_launcher.

HealthCheckChain runs every check (a full report, not just the first failure) and returns
their results; the Wrapper excludes the rank if any is unhealthy. The Chained* variants
check the rank's own device (LOCAL_RANK), which is what a rank should look at after a
fault. node_health_check() is the ft_launcher hook (--health-check
nvrx_core.health:node_health_check): every GPU of the node, NVML only (the launcher must
not create a CUDA context).
"""

from typing import Callable, List, Optional, Tuple

from nvrx_core import events as ev
from nvrx_core.health.cuda import CudaHealthCheck
from nvrx_core.health.gpu import GPUHealthCheck, NVLHealthCheck
from nvrx_core.health.result import HealthResult, Status


class HealthCheckChain:
    """Runs every check; with `events`, each result is also a `health_check` event."""

    def __init__(self, *checks: Callable[[], HealthResult], events: Optional[ev.EventLog] = None):
        self.checks = checks
        self.events = events

    def __call__(self) -> List[HealthResult]:
        results = []
        for check in self.checks:
            try:
                results.append(check())
            except Exception as e:  # a broken check is a failed check, not a crashed rank
                name = getattr(check, "name", None) or getattr(check, "__name__", type(check).__name__)
                results.append(HealthResult(name, Status.UNHEALTHY, f"check raised {type(e).__name__}: {e}"))
            if self.events is not None:
                self.events.emit(ev.HEALTH_CHECK, **results[-1].to_dict())
        return results


class ChainedGPUHealthCheck(GPUHealthCheck):
    """GPUHealthCheck of this rank's device."""

    def __init__(self, **kwargs):
        super().__init__(devices="local", **kwargs)


class ChainedNVLHealthCheck(NVLHealthCheck):
    """NVLHealthCheck of this rank's device."""

    def __init__(self, **kwargs):
        super().__init__(devices="local", **kwargs)


class ChainedCudaHealthCheck(CudaHealthCheck):
    """CudaHealthCheck of this rank's device."""

    def __init__(self, timeout: float = 30.0):
        super().__init__(timeout=timeout, device="local")


def rank_health_checks(cuda_timeout: float = 30.0) -> HealthCheckChain:
    """The chain a Wrapper uses by default when asked for health checks: GPU, NVLink, CUDA."""
    return HealthCheckChain(ChainedGPUHealthCheck(), ChainedNVLHealthCheck(), ChainedCudaHealthCheck(cuda_timeout))


def node_health_check() -> Tuple[bool, str]:
    """ft_launcher --health-check hook: (healthy, detail) for every GPU of this node."""
    results = HealthCheckChain(GPUHealthCheck(), NVLHealthCheck())()
    combined = HealthResult.combine("node", results)
    return combined.healthy, f"{combined.status.value}: {combined.detail}"
