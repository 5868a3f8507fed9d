"""Fault tolerance: config, protocol, node monitor, rank client, launcher, simulated faults.

The rank-side API, importable without starting anything:
    from nvrx_core.ft import RankMonitorClient, FTConfig, SimulatedFault, FaultInjector
"""

from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.faults import FaultInjector, SimulatedFault
from nvrx_core.ft.finished import write_finished_flag

__all__ = ["RankMonitorClient", "FTConfig", "FaultInjector", "SimulatedFault", "write_finished_flag"]
