"""Imported as `nvrx_lightning`.

Lightning callbacks for nvrx-suite: translations of Lightning's hooks onto nvrx_core, where
every mechanism lives. `Trainer(callbacks=[NVRxFaultTolerance()])`; see docs/lightning.md.
"""

from nvrx_lightning.fault_tolerance import (FaultToleranceCallback, NVRxFaultTolerance, SimulatedFaultParams,
                                            training_completed)

__all__ = ["NVRxFaultTolerance", "FaultToleranceCallback", "SimulatedFaultParams", "training_completed"]
