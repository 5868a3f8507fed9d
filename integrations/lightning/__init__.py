"""Imported as `nvrx_lightning`.

Lightning callbacks and a CheckpointIO for nvrx-suite: translations of Lightning's hooks onto
nvrx_core, where every mechanism lives. `Trainer(callbacks=[NVRxFaultTolerance()])`; see
docs/lightning.md.
"""

from nvrx_lightning.checkpoint_io import NVRxAsyncCheckpointIO
from nvrx_lightning.fault_tolerance import (FaultToleranceCallback, NVRxFaultTolerance, SimulatedFaultParams,
                                            training_completed)
from nvrx_lightning.preemption import NVRxPreemption
from nvrx_lightning.straggler import NVRxStragglerDetection

__all__ = [
    "NVRxFaultTolerance", "FaultToleranceCallback", "SimulatedFaultParams", "training_completed",
    "NVRxStragglerDetection", "NVRxPreemption", "NVRxAsyncCheckpointIO",
]
