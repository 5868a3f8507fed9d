"""Megatron-core's RerunStateMachine names, on nvrx_core.rerun, built from Bridge's config.

Megatron's train step keeps its shape::

    machine = RerunStateMachine(cfg.rerun_state_machine)          # Bridge's RerunStateMachineConfig
    data_iterator = RerunDataIterator(loader)
    while machine.should_run_forward_backward(data_iterator):
        zero_grad(); loss = forward_backward(next(data_iterator))
        machine.validate_result(loss, torch.isnan, "loss is NaN", fatal=True)
        machine.validate_result(loss, partial(machine.is_unexpectedly_large, threshold=10, context="loss"),
                                "Spiky loss", fatal=False)
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
    if should_checkpoint: save({..., "rerun_state_machine": machine.state_dict(data_iterator, "torch_dist")})
    if should_exit: sys.exit(exit_code)                           # 16 or 17, nvrx_core.exit_codes
    optimizer.step()

Every decision is the core machine's (docs/rerun.md): one agreed vote per protocol call over
the process group's device (CPU for gloo), RNG snapshots, microbatch replay, the
rejected-results log and events. Differences from Megatron-core, each deliberate:

- An object, not a global: build one per training run (no initialize/get pair).
- A result that reproduces in place is always re-checked on another device (checkpoint,
  exit 16), fatal or not; Megatron goes on after a reproduced non-fatal result without
  knowing whether the device is at fault. After the re-check elsewhere a non-fatal result
  goes on, a fatal one exits 17.
- `current_iteration` counts steps begun, from 1 (Megatron's starts at 0); set it between
  steps to align it with the loop's counter.
- `state_dict(...)` returns None between steps, as Megatron's does, unless `force=True`;
  the state is plain data, so every checkpoint format takes it (`ckpt_format` is kept for
  Megatron's signature). `force=True` also keeps the iteration count and the spiky-loss and
  large-value references across ordinary checkpoints.
- `is_unexpectedly_large` keeps Megatron's rule (nvrx_core.rerun.LargeValueTracker) except
  that a reference of 0 flags nothing and `resample` starts a new reference.
"""

from typing import Any, Callable, Optional, Tuple

import torch

from nvrx_core.events import EventLog
from nvrx_core.exit_codes import ExitCode
from nvrx_core.rerun import (CallbackStateAdapter, DeviceIdentity, LargeValueTracker, RerunDataIterator,
                             RerunDiagnostic, RerunMode, RerunState, RerunStateError, RerunValidationError)
from nvrx_core.rerun import RerunStateMachine as CoreRerunStateMachine
from nvrx_megatron import convert
from nvrx_megatron.config import RerunStateMachineConfig

EXIT_CODE_RESUME_TO_DISAMBIGUATE: int = int(ExitCode.RERUN_RESUME_ELSEWHERE)
"""16: the suspicious result reproduced here; a checkpoint was saved, resume on another device."""

EXIT_CODE_FAILED_ON_RESULT_VALIDATION: int = int(ExitCode.RERUN_VALIDATION_FAILED)
"""17: validation failed for good (fatal transient error, or a result that reproduced elsewhere)."""

STATE_FORMAT = "nvrx_megatron.rerun_state_machine/1"
"""Tag of this facade's state dict: the core machine's state plus the large-value references."""


class RerunStateMachine:
    """Megatron's rerun state machine API over one nvrx_core.rerun.RerunStateMachine.

    `config`: any object with Bridge's RerunStateMachineConfig fields, read by name (Bridge's
    own class, this package's, a SimpleNamespace; default: rerun_mode "disabled").
    `state_save_func` / `state_restore_func`: Megatron's pair for state a rerun must restore
    beyond the RNGs (e.g. a model-parallel RNG tracker); both or neither.
    Not Megatron's, keyword-only: `process_group`, `device`, `device_identity` (a test
    simulating another device), `events`, `tensor_ops_on_cpu`, and `core_overrides`
    (RerunConfig knobs Bridge has no field for: result_rejected_tracker_filename,
    max_same_device_restarts, spiky_loss_window, ...).
    """

    def __init__(self, config: Any = None, *,
                 state_save_func: Optional[Callable[[], Any]] = None,
                 state_restore_func: Optional[Callable[[Any], None]] = None,
                 process_group: Any = None, device: Optional[torch.device] = None,
                 device_identity: Optional[DeviceIdentity] = None, events: Optional[EventLog] = None,
                 tensor_ops_on_cpu: bool = False, **core_overrides: Any):
        config = RerunStateMachineConfig() if config is None else config
        core_config = convert.rerun_config(config, **core_overrides)
        if (state_save_func is None) != (state_restore_func is None):
            raise ValueError("state_save_func and state_restore_func: pass both (what to save and how to "
                             "restore it) or neither")
        for name, func in (("state_save_func", state_save_func), ("state_restore_func", state_restore_func)):
            if func is not None and not callable(func):
                raise TypeError(f"{name}: expected a callable, got {type(func).__name__}")
        extra = [CallbackStateAdapter(state_save_func, state_restore_func)] if state_save_func else []
        self.config = config
        self.machine = CoreRerunStateMachine(
            core_config, process_group=process_group, device=device,
            device_identity=device_identity, extra_state_adapters=extra, events=events,
            tensor_ops_on_cpu=tensor_ops_on_cpu)
        """The nvrx_core machine (diagnoses, validate_loss, report_determinism_stats, ...)."""
        self._large_values = LargeValueTracker()

    # ------------------------------------------------------------- Megatron's API
    @property
    def mode(self) -> RerunMode:
        return self.machine.mode

    def get_mode(self) -> RerunMode:
        return self.machine.mode

    @property
    def state(self) -> RerunState:
        """The core's state (its names, not Megatron's enum: the table in docs/rerun.md)."""
        return self.machine.state

    @property
    def current_iteration(self) -> int:
        """Steps begun so far (1-based); travels in checkpoints and names the iteration in logs."""
        return self.machine.current_iteration

    @current_iteration.setter
    def current_iteration(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"current_iteration={value!r}: must be an integer >= 0")
        if self.machine.state is not RerunState.NOT_RUNNING_YET:
            raise RuntimeError(f"current_iteration set in state {self.machine.state.value!r}: set it between steps")
        self.machine.current_iteration = value

    def should_run_forward_backward(self, data_iterator: Any) -> bool:
        """True: run the step's forward/backward (again); False: leave the loop. `data_iterator`:
        a RerunDataIterator, a list of them (None for stages without data), or None."""
        return self.machine.should_run_forward_backward(data_iterator)

    def validate_result(self, result: Any, rejection_func: Callable[[Any], Any], message: str,
                        comparison_func: Optional[Callable[[Any, Any], float]] = None,
                        tolerance: float = 0.0, fatal: bool = True) -> None:
        """Check `result` inside the loop; `rejection_func(result)` is truthy for a bad one (a
        tensor flag is fine). `tolerance`: the largest `comparison_func(initial, rerun)` (default:
        relative difference) that counts as the same result. Disabled mode: a fatal rejection
        raises RerunValidationError (a RuntimeError, as Megatron raises)."""
        self.machine.validate_result(result, rejection_func, message, comparison_func, tolerance, fatal)

    def validate_loss(self, loss: Any, tolerance: float = 0.0) -> None:
        """The config's loss checks (check_for_nan_in_loss, check_for_spiky_loss); not in Megatron."""
        self.machine.validate_loss(loss, tolerance)

    def is_unexpectedly_large(self, result: Any, threshold: float, context: str, num_samples: int = 100,
                              resample: bool = False) -> bool:
        """Rejection function: |result| >= threshold x the largest |value| among the first
        `num_samples` finite values of `context` (those are never flagged; NaN/Inf never are)."""
        return self._large_values(result, threshold, context, num_samples, resample)

    def should_checkpoint_and_exit(self) -> Tuple[bool, bool, int]:
        """(should_checkpoint, should_exit, exit_code) after the loop, before the optimizer step:
        (False, False, 0), (True, True, 16) or (False, True, 17)."""
        checkpoint, leave, code = self.machine.should_checkpoint_and_exit()
        return checkpoint, leave, int(code)

    def state_dict(self, data_iterator: Any = None, ckpt_format: str = "torch_dist",
                   force: bool = False) -> Optional[dict]:
        """Plain data for the checkpoint (torch.load(weights_only=True) reads it back); None
        between steps unless `force`. Pass the iterator(s) the step ran with."""
        if not isinstance(ckpt_format, str):
            raise TypeError(f"ckpt_format: expected a string, got {type(ckpt_format).__name__}")
        if not isinstance(force, bool):
            raise TypeError(f"force={force!r}: must be True or False")
        if not force and self.machine.state is RerunState.NOT_RUNNING_YET:
            return None
        return {"format": STATE_FORMAT, "machine": self.machine.state_dict(data_iterator),
                "large_values": self._large_values.state_dict()}

    def load_state_dict(self, state_dict: Any, abandon_pending_rerun: bool = False) -> None:
        """Restore from `state_dict()` (or a core machine's state), validated before anything
        changes. A pending re-check makes the next step that re-check, unless
        `abandon_pending_rerun` (or a mode other than validate_results) drops it."""
        if not isinstance(state_dict, dict):
            raise RerunStateError(f"state_dict: expected the mapping state_dict() returned, "
                                  f"got {type(state_dict).__name__}")
        if "format_version" in state_dict:  # a core machine's own state
            self.machine.load_state_dict(state_dict, abandon_pending_rerun)
            return
        if state_dict.get("format") != STATE_FORMAT or set(state_dict) != {"format", "machine", "large_values"}:
            raise RerunStateError(f"state_dict: keys {sorted(state_dict)} with format {state_dict.get('format')!r}; "
                                  f"expected format {STATE_FORMAT!r} with keys format, machine, large_values")
        large_values = LargeValueTracker()
        try:
            large_values.load_state_dict(state_dict["large_values"])
        except ValueError as e:
            raise RerunStateError(f"state_dict: {e}") from None
        self.machine.load_state_dict(state_dict["machine"], abandon_pending_rerun)
        self._large_values = large_values


__all__ = ["EXIT_CODE_FAILED_ON_RESULT_VALIDATION", "EXIT_CODE_RESUME_TO_DISAMBIGUATE", "RerunDataIterator",
           "RerunDiagnostic", "RerunMode", "RerunState", "RerunStateMachine", "RerunValidationError"]
