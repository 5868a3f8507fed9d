"""RunChecks: the validate_result calls of one step, and how its rerun compared.

A call is identified by its message and its rank among the calls with that message in the
step ("loss is NaN or Inf" #0): the rerun executes the same code, so the same call comes
back in the same position. Flags that are tensors stay tensors until the step's single
read-back (the vote); a flag computed on the host is a bool.
"""

import dataclasses
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from nvrx_core.rerun.config import RerunDiagnostic
from nvrx_core.rerun.injection import RerunErrorInjector
from nvrx_core.rerun.persist import FailedCall
from nvrx_core.rerun.states import RerunEvent

Flag = Union[bool, torch.Tensor]


@dataclasses.dataclass
class Check:
    message: str
    sequence: int
    result: Any
    flag: Flag
    fatal: bool
    injected: Optional[RerunDiagnostic]


def as_flag(flag: Any) -> Flag:
    """A rejection function's answer as a bool or a one-element tensor (any element rejects)."""
    if isinstance(flag, torch.Tensor):
        return flag if flag.numel() == 1 else flag.any()
    return bool(flag)


def _detached(result: Any) -> Any:
    return result.detach() if isinstance(result, torch.Tensor) else result


def _on_host(result: Any) -> Any:
    """A copy that outlives the step and can go into a checkpoint."""
    return result.detach().cpu().clone() if isinstance(result, torch.Tensor) else float(result)


class RunChecks:
    def __init__(self) -> None:
        self.checks: List[Check] = []
        self.initial_results: Dict[Tuple[str, int], Any] = {}
        self.rerun_result: Any = None
        self._counts: Dict[str, int] = {}
        self._injected = False
        self._reproduced: Optional[bool] = None

    def _sequence(self, message: str) -> int:
        sequence = self._counts.get(message, 0)
        self._counts[message] = sequence + 1
        return sequence

    # ---------------------------------------------------------- initial run
    def record(
        self, message: str, result: Any, flag: Any, fatal: bool, keep_initial: bool, injector: RerunErrorInjector
    ) -> None:
        sequence = self._sequence(message)
        if keep_initial:
            self.initial_results[(message, sequence)] = _detached(result)
            return
        injected = None
        if not self._injected:
            injected = injector.draw()
            self._injected = injected is not None
        flag = True if injected is not None else as_flag(flag)
        if flag is False:
            return  # accepted on the spot: nothing to keep
        self.checks.append(Check(message, sequence, _detached(result), flag, fatal, injected))

    def any_rejected(self) -> Flag:
        """True/False, or a device tensor still being computed (read back by the vote)."""
        if any(c.flag is True for c in self.checks):
            return True
        flags = [c.flag for c in self.checks if isinstance(c.flag, torch.Tensor)]
        if not flags:
            return False
        if len(flags) == 1:
            return flags[0]
        device = flags[0].device
        return torch.stack([f.reshape(()).to(device) for f in flags]).any()

    def first_rejected(self, iteration: int) -> Optional[FailedCall]:
        """The earliest rejected call of this rank (reads device flags back: rejection path only)."""
        device_flags = [c.flag for c in self.checks if isinstance(c.flag, torch.Tensor)]
        values = iter([])
        if device_flags:
            device = device_flags[0].device
            values = iter(torch.stack([f.reshape(()).to(device) for f in device_flags]).tolist())
        for check in self.checks:
            rejected = next(values) if isinstance(check.flag, torch.Tensor) else check.flag
            if rejected:
                return FailedCall(iteration, check.message, check.sequence, check.fatal,
                                  _on_host(check.result), check.injected)
        return None

    # ---------------------------------------------------------------- reruns
    def start_rerun(self) -> None:
        self.checks = []
        self._counts = {}
        self._reproduced = None
        self.rerun_result = None

    def initial_result(self, message: str) -> Any:
        """Determinism stats: the initial run's result of the call the rerun just made."""
        sequence = self._sequence(message)
        try:
            return self.initial_results[(message, sequence)]
        except KeyError:
            raise RuntimeError(
                f"validate_result({message!r}) #{sequence} in the rerun has no counterpart in the initial "
                "run: determinism stats need the same validate_result calls in both runs"
            ) from None

    def compare(
        self, failed: Optional[FailedCall], message: str, result: Any, compare: Any,
        tolerance: float, injector: RerunErrorInjector, in_place: bool,
    ) -> None:
        """At the rerun of the rejected call: did the result reproduce (difference <= tolerance)?"""
        sequence = self._sequence(message)
        if failed is None or (message, sequence) != (failed.message, failed.sequence):
            return
        if failed.injected is not None:
            kind = failed.injected
            difference = injector.in_place_comparison(kind) if in_place else injector.elsewhere_comparison(kind)
        else:
            difference = float(compare(failed.initial_result, result))
        self._reproduced = difference <= tolerance
        self.rerun_result = _on_host(result)

    def outcome(self, failed: FailedCall, in_place: bool) -> RerunEvent:
        """This rank's verdict on its rejected call; a call the rerun never reached did not reproduce."""
        reproduced = bool(self._reproduced)
        if in_place:
            if reproduced:
                return RerunEvent.REPRODUCED
            return RerunEvent.FATAL_TRANSIENT_ERROR if failed.fatal else RerunEvent.TRANSIENT_ERROR
        if reproduced:
            return RerunEvent.FATAL_CORRECT_RESULT if failed.fatal else RerunEvent.CORRECT_RESULT
        return RerunEvent.PERSISTENT_ERROR
