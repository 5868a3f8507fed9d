"""Imported as `nvrx_megatron`.

Megatron-Bridge-compatible resiliency for nvrx-suite: Bridge's four configs, with Bridge's
names, field order and defaults, so a Bridge-style loop ports by changing its imports. The
loop hooks come with the issues that build them; the mechanisms live in nvrx_core, and these
configs only check values and translate them onto the core's configs.
"""

from nvrx_megatron.config import (FaultToleranceConfig, InProcessRestartConfig, NVRxStragglerDetectionConfig,
                                  RerunStateMachineConfig)

__all__ = ["FaultToleranceConfig", "InProcessRestartConfig", "NVRxStragglerDetectionConfig",
           "RerunStateMachineConfig"]
