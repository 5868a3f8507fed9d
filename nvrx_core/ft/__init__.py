"""Fault tolerance: config, protocol, node monitor, rank client, launcher, simulated faults.

The rank-side API, importable without starting anything:
    from nvrx_core.ft import RankMonitorClient, FTConfig, SimulatedFault, FaultInjector
and under nvidia-resiliency-ext's names (`nvidia_resiliency_ext.fault_tolerance`), so its
users change only the import:
    from nvrx_core.ft import FaultToleranceConfig, RankMonitorClient, RankMonitorClientError
"""

from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.config import FaultToleranceConfig, FTConfig
from nvrx_core.ft.faults import FaultInjector, SimulatedFault
from nvrx_core.ft.finished import write_finished_flag
from nvrx_core.ft.nvrx_names import (HeartbeatTimeouts, RankMonitorClientError, SectionTimeouts, WorkloadAction,
                                     WorkloadControlRequest)

__all__ = [
    "RankMonitorClient", "FTConfig", "FaultInjector", "SimulatedFault", "write_finished_flag",
    "FaultToleranceConfig", "RankMonitorClientError", "HeartbeatTimeouts", "SectionTimeouts",
    "WorkloadAction", "WorkloadControlRequest",
]
