"""Imported as `nvrx_lightning`.

Lightning callbacks and a CheckpointIO for nvrx-suite: translations of Lightning's hooks onto
nvrx_core, where every mechanism lives. `Trainer(callbacks=[NVRxFaultTolerance()])`; see
docs/lightning.md. nvidia-resiliency-ext's `ptl_resiliency` callbacks are here under their
own names (nvrx_lightning.nvrx_names), so code written for them changes only its import.
"""

from nvrx_lightning.checkpoint_io import NVRxAsyncCheckpointIO
from nvrx_lightning.fault_tolerance import NVRxFaultTolerance, training_completed
from nvrx_lightning.nvrx_names import (FaultToleranceCallback, FaultToleranceSectionsCallback, SimulatedFaultParams,
                                       StragglerDetectionCallback)
from nvrx_lightning.preemption import NVRxPreemption
from nvrx_lightning.straggler import NVRxStragglerDetection

__all__ = [
    "NVRxFaultTolerance", "training_completed", "NVRxStragglerDetection", "NVRxPreemption", "NVRxAsyncCheckpointIO",
    "FaultToleranceCallback", "FaultToleranceSectionsCallback", "SimulatedFaultParams", "StragglerDetectionCallback",
]
