"""Imported as `nvrx_megatron`.

Megatron-Bridge-compatible resiliency for nvrx-suite: Bridge's four configs, with Bridge's
names, field order and defaults, so a Bridge-style loop ports by changing its imports. The
hooks that take a config (fault_tolerance, nvrx_straggler, inprocess_restart,
rerun_state_machine) read any Bridge-shaped object by field name through `convert`, so
Bridge's own config objects work as well; the mechanisms live in nvrx_core.
"""

from nvrx_megatron.config import (FaultToleranceConfig, InProcessRestartConfig, NVRxStragglerDetectionConfig,
                                  RerunStateMachineConfig)

__all__ = ["FaultToleranceConfig", "InProcessRestartConfig", "NVRxStragglerDetectionConfig",
           "RerunStateMachineConfig"]
