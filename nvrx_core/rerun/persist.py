"""The machine's checkpoint format, and its validation on load.

The state is plain data (tensors, numbers, strings, lists, dicts) so it loads with
torch.load(weights_only=True) and needs none of this package's classes. A resumed job
that loads a damaged or foreign state must fail at load time, naming the field, not
several steps later inside the protocol.
"""

import dataclasses
import logging
from typing import Any, List, Optional, Sequence

import torch

from nvrx_core.rerun.adapters import DeviceIdentity, StateAdapter
from nvrx_core.rerun.config import RerunDiagnostic, RerunMode
from nvrx_core.rerun.data import RerunDataIterator, check_state_dict as check_iterator_state
from nvrx_core.rerun.spiky import SpikyLossDetector
from nvrx_core.rerun.states import CHECKPOINTABLE_STATES, RerunState

logger = logging.getLogger("nvrx.rerun")

FORMAT_VERSION = 1
KEYS = (
    "format_version", "mode", "state", "current_iteration", "same_device_restarts",
    "failed_call", "saved_state", "data_iterators", "spiky_loss",
)


class RerunStateError(ValueError):
    """A rerun state dict (from a checkpoint) is malformed; the message names the field."""


@dataclasses.dataclass
class FailedCall:
    """The rejected validation this rank is chasing through the reruns."""

    iteration: int
    message: str
    sequence: int
    """Which call with this message in the step (the same code path calls validate_result in the same order)."""
    fatal: bool
    initial_result: Any
    """float, or a CPU tensor."""
    injected: Optional[RerunDiagnostic] = None
    suspicious_device: Optional[DeviceIdentity] = None
    """Where the result reproduced in place: a resumed job must not re-check it there."""

    def to_state(self) -> dict:
        return {
            "iteration": self.iteration,
            "message": self.message,
            "sequence": self.sequence,
            "fatal": self.fatal,
            "initial_result": self.initial_result,
            "injected": self.injected.value if self.injected else None,
            "suspicious_device": self.suspicious_device.to_dict() if self.suspicious_device else None,
        }

    @classmethod
    def from_state(cls, data: Any) -> "FailedCall":
        field = "failed_call"
        _require(isinstance(data, dict), field, type(data).__name__, "must be a mapping")
        expected = {"iteration", "message", "sequence", "fatal", "initial_result", "injected", "suspicious_device"}
        _require(set(data) == expected, field, sorted(data), f"must have exactly the keys {sorted(expected)}")
        _require_count(data["iteration"], f"{field}.iteration", low=1)
        _require_count(data["sequence"], f"{field}.sequence", low=0)
        _require(isinstance(data["message"], str), f"{field}.message", data["message"], "must be a string")
        _require(isinstance(data["fatal"], bool), f"{field}.fatal", data["fatal"], "must be true or false")
        result = data["initial_result"]
        _require(
            isinstance(result, torch.Tensor) or (isinstance(result, (int, float)) and not isinstance(result, bool)),
            f"{field}.initial_result", type(result).__name__, "must be a number or a tensor",
        )
        injected = data["injected"]
        _require(
            injected is None or injected in {d.value for d in RerunDiagnostic},
            f"{field}.injected", injected, "must be null or an error_injection_type",
        )
        device = data["suspicious_device"]
        try:
            identity = DeviceIdentity.from_dict(device, f"{field}.suspicious_device") if device is not None else None
        except ValueError as e:
            raise RerunStateError(str(e)) from None
        return cls(
            iteration=data["iteration"], message=data["message"], sequence=data["sequence"],
            fatal=data["fatal"], initial_result=result,
            injected=RerunDiagnostic(injected) if injected else None, suspicious_device=identity,
        )


@dataclasses.dataclass
class MachineCheckpoint:
    mode: RerunMode
    state: RerunState
    current_iteration: int
    same_device_restarts: int
    failed_call: Optional[FailedCall]
    saved_state: Optional[List[Any]]
    data_iterators: List[Optional[dict]]


def _require(condition: bool, field: str, value: Any, rule: str) -> None:
    if not condition:
        raise RerunStateError(f"rerun state: {field}={value!r}: {rule}")


def _require_count(value: Any, field: str, low: int) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= low, field, value, f"must be an integer >= {low}")


def parse_state_dict(data: Any, adapters: Sequence[StateAdapter], spiky: SpikyLossDetector) -> MachineCheckpoint:
    """Check every field of a state written by RerunStateMachine.state_dict(); load `spiky` from it."""
    adapters_count = len(adapters)
    _require(isinstance(data, dict), "state", type(data).__name__, "must be a mapping (from RerunStateMachine.state_dict())")
    _require(data.get("format_version") == FORMAT_VERSION, "format_version", data.get("format_version"), f"must be {FORMAT_VERSION}")
    missing = [k for k in KEYS if k not in data]
    _require(not missing, "state", sorted(data), f"is missing {missing}")
    unknown = sorted(set(data) - set(KEYS))
    _require(not unknown, "state", unknown, "unknown keys")
    try:
        mode = RerunMode(data["mode"])
    except ValueError:
        raise RerunStateError(f"rerun state: mode={data['mode']!r}: not a rerun mode") from None
    try:
        state = RerunState(data["state"])
    except ValueError:
        raise RerunStateError(f"rerun state: state={data['state']!r}: not a rerun state") from None
    _require(
        state in CHECKPOINTABLE_STATES, "state", state.value,
        f"a checkpoint is only taken in {[s.value for s in CHECKPOINTABLE_STATES]}",
    )
    _require_count(data["current_iteration"], "current_iteration", low=0)
    _require_count(data["same_device_restarts"], "same_device_restarts", low=0)
    pending = state is RerunState.WILL_RERUN_FROM_CHECKPOINT
    failed = FailedCall.from_state(data["failed_call"]) if data["failed_call"] is not None else None
    _require(failed is None or pending, "failed_call", "set", f"only a {RerunState.WILL_RERUN_FROM_CHECKPOINT.value} state carries one")
    if failed is not None:
        _require(
            failed.iteration == data["current_iteration"], "failed_call.iteration", failed.iteration,
            f"must equal current_iteration ({data['current_iteration']})",
        )
        _require(failed.suspicious_device is not None, "failed_call.suspicious_device", None, "must be set once the result reproduced")
    saved = data["saved_state"]
    if pending:
        _require(
            isinstance(saved, list) and len(saved) == adapters_count, "saved_state",
            type(saved).__name__, f"must be a list of {adapters_count} snapshot(s), one per state adapter",
        )
    else:
        _require(saved is None, "saved_state", type(saved).__name__, "must be null between steps")
    iterators = data["data_iterators"]
    _require(isinstance(iterators, list), "data_iterators", type(iterators).__name__, "must be a list")
    for i, it in enumerate(iterators):
        if it is None:
            continue
        try:
            check_iterator_state(it, f"data_iterators[{i}]")
        except ValueError as e:
            raise RerunStateError(f"rerun state: {e}") from None
        _require(
            pending or it["batches"] is None, f"data_iterators[{i}].batches", "set",
            "microbatches are only saved for a pending rerun",
        )
    try:
        for i, (adapter, snapshot) in enumerate(zip(adapters, saved or [])):
            adapter.check_snapshot(snapshot, f"saved_state[{i}]")
        spiky.load_state_dict(data["spiky_loss"])
    except ValueError as e:
        raise RerunStateError(f"rerun state: {e}") from None
    return MachineCheckpoint(
        mode=mode, state=state, current_iteration=data["current_iteration"],
        same_device_restarts=data["same_device_restarts"], failed_call=failed,
        saved_state=saved, data_iterators=iterators,
    )


def apply_iterator_states(iterators: List[Optional[RerunDataIterator]], states: List[Optional[dict]]) -> None:
    """Give the resumed job's data iterators the loaded states (counters, and microbatches to replay)."""
    if len(states) != len(iterators):
        message = (f"the checkpoint holds state for {len(states)} data iterator(s), but "
                   f"should_run_forward_backward() got {len(iterators)}")
        if any(s is not None and s["batches"] is not None for s in states):
            raise RerunStateError(message + ": the step to re-check needs its microbatches")
        logger.warning("rerun: %s; their draw counters start from 0", message)
        return
    for it, state in zip(iterators, states):
        if it is not None and state is not None:
            it.load_state_dict(state)
