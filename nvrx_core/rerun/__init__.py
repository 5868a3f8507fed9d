"""Rerun state machine: tells data problems, transient faults and faulty devices apart.

See docs/rerun.md. The public surface (names follow Megatron-LM's rerun_state_machine):
RerunStateMachine, RerunConfig (alias RerunStateMachineConfig), RerunMode,
RerunDiagnostic, RerunDataIterator, RerunState/RerunEvent (the transition table), the
adapters, the rejected-results log readers and LargeValueTracker (Megatron's
is_unexpectedly_large rule).
"""

from nvrx_core.rerun.adapters import CallbackStateAdapter, DeviceIdentity, RngStateAdapter, local_device_identity
from nvrx_core.rerun.config import RerunConfig, RerunDiagnostic, RerunMode, RerunStateMachineConfig
from nvrx_core.rerun.data import RerunDataIterator
from nvrx_core.rerun.injection import RerunErrorInjector
from nvrx_core.rerun.large_values import LargeValueTracker
from nvrx_core.rerun.checks import reject_non_finite
from nvrx_core.rerun.machine import RerunStateMachine, RerunValidationError
from nvrx_core.rerun.persist import RerunStateError
from nvrx_core.rerun.report import RejectedResult, iterations_to_skip, read_rejected_results
from nvrx_core.rerun.spiky import SpikyLossDetector
from nvrx_core.rerun.states import (
    TRANSITIONS, InvalidTransition, RerunEvent, RerunState, format_transition_table, next_state,
)
from nvrx_core.rerun.stats import relative_difference

__all__ = [
    "CallbackStateAdapter", "DeviceIdentity", "InvalidTransition", "LargeValueTracker", "RejectedResult", "RerunConfig",
    "RerunDataIterator", "RerunDiagnostic", "RerunErrorInjector", "RerunEvent", "RerunMode", "RerunState",
    "RerunStateError", "RerunStateMachine", "RerunStateMachineConfig", "RerunValidationError",
    "RngStateAdapter", "SpikyLossDetector", "TRANSITIONS", "format_transition_table", "iterations_to_skip",
    "local_device_identity", "next_state", "read_rejected_results", "reject_non_finite", "relative_difference",
]
