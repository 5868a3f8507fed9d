"""GPU / NVLink / CUDA health checks (NVML through nvidia-ml-py's `pynvml`).

Each check returns a HealthResult: healthy, unhealthy, or not applicable (no NVML, no GPU,
no NVLink: the launcher and the Wrapper go on).
"""

from nvrx_core.health.chain import (ChainedCudaHealthCheck, ChainedGPUHealthCheck, ChainedNVLHealthCheck,
                                    HealthCheckChain, node_health_check, rank_health_checks)
from nvrx_core.health.cuda import CudaHealthCheck
from nvrx_core.health.gpu import GPUHealthCheck, NVLHealthCheck, check_device
from nvrx_core.health.nvml import NvmlSession, NvmlUnavailable, process_nvml
from nvrx_core.health.result import HealthResult, Status

__all__ = [
    "ChainedCudaHealthCheck", "ChainedGPUHealthCheck", "ChainedNVLHealthCheck", "CudaHealthCheck", "GPUHealthCheck",
    "HealthCheckChain", "HealthResult", "NVLHealthCheck", "NvmlSession", "NvmlUnavailable", "Status", "check_device",
    "node_health_check", "process_nvml", "rank_health_checks",
]
