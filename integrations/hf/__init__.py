"""Imported as `nvrx_hf`.

Hugging Face `transformers.Trainer` callbacks for nvrx-suite: translations of the Trainer's
callback events onto nvrx_core, where every mechanism lives.
`Trainer(..., callbacks=[NVRxFaultTolerance(), NVRxPreemption(), NVRxStragglerDetection()])`; see docs/hf.md.
"""

from nvrx_hf.fault_tolerance import NVRxFaultTolerance
from nvrx_hf.preemption import NVRxPreemption
from nvrx_hf.straggler import NVRxStragglerDetection

__all__ = ["NVRxFaultTolerance", "NVRxPreemption", "NVRxStragglerDetection"]
