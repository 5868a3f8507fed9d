"""The rejected-results log: one JSON line per rejected result and per diagnosis.

Operators use it to drain a faulty GPU; training scripts use it to skip data that makes
the model produce bad results (`iterations_to_skip`). Every rank appends to the same file
with O_APPEND and one write() per line (lines of concurrent ranks do not interleave), then
fsyncs: the line that explains an exit must survive the exit.
"""

import dataclasses
import json
import logging
import math
import os
from typing import Any, Callable, Iterator, List, Optional, Set

import torch

from nvrx_core import events as ev
from nvrx_core.events import EventLog

logger = logging.getLogger("nvrx.rerun")

# Statuses (where in the protocol a record was written), named as in Megatron-LM.
RERUN_DISABLED = "rerun_disabled"
INITIAL_RUN = "initial_run"
FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"
SAME_DEVICE_AGAIN = "same_device_again"
SAME_DEVICE_GAVE_UP = "same_device_gave_up"
PENDING_RERUN_ABANDONED = "pending_rerun_abandoned"

# Diagnoses beyond the three RerunDiagnostic values.
UNDETERMINED = "undetermined"


@dataclasses.dataclass
class RejectedResult:
    time: float
    iteration: int
    rank: int
    host: str
    device: str
    status: str
    message: str
    result: Optional[str]
    diagnosis: Optional[str] = None
    """correct_result (application/data), transient_error, persistent_error, undetermined; None while pending."""
    detail: str = ""
    suspect_device: Optional[str] = None
    """The device the result reproduced on in place (the one to drain if the diagnosis is persistent_error)."""


class RejectedResultsLog:
    def __init__(self, path: Optional[str]):
        self.path = path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def append(self, record: RejectedResult) -> None:
        if not self.path:
            return
        line = (json.dumps(dataclasses.asdict(record), default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


def describe_result(result: Any) -> str:
    """A short text for logs: the value of a scalar, a summary of a larger tensor."""
    if isinstance(result, torch.Tensor):
        if result.numel() == 1:
            return repr(float(result.detach().reshape(()).item()))
        finite = result.detach().float()
        bad = int((~torch.isfinite(finite)).sum().item())
        return f"tensor(shape={tuple(result.shape)}, non_finite={bad}, absmax={float(finite.abs().nan_to_num(0, 0, 0).max().item()) if result.numel() else 0.0:g})"
    value = float(result)
    return repr(value) if not math.isnan(value) else "nan"


class RejectionReporter:
    """Writes each rejected result and each diagnosis to the log file, the event log and the Python log."""

    def __init__(self, log: RejectedResultsLog, events: EventLog, clock: Callable[[], float]):
        self._log = log
        self._events = events
        self._clock = clock
        self.diagnoses: List[RejectedResult] = []

    def record(self, status: str, *, iteration: int, rank: int, host: str, device: str, message: str,
               result: Any, diagnosis: Optional[str] = None, detail: str = "", injected: Optional[str] = None,
               suspect_device: Optional[str] = None) -> None:
        record = RejectedResult(
            time=self._clock(), iteration=iteration, rank=rank, host=host, device=device, status=status,
            message=message, result=describe_result(result) if result is not None else None,
            diagnosis=diagnosis, detail=detail, suspect_device=suspect_device,
        )
        self._log.append(record)
        fields = {k: v for k, v in dataclasses.asdict(record).items() if k not in ("time", "rank")}
        if injected:
            fields["injected"] = injected
        if diagnosis is None:
            logger.warning("rerun: rank %d iteration %d: %s: %s (%s) %s", rank, iteration, status, record.result, message, detail)
            self._events.emit(ev.RERUN_RESULT_REJECTED, rank=rank, **fields)
        else:
            self.diagnoses.append(record)
            logger.error("rerun: rank %d iteration %d: diagnosis %s: %s", rank, iteration, diagnosis, detail)
            self._events.emit(ev.RERUN_DIAGNOSIS, rank=rank, **fields)


def read_rejected_results(path: str) -> List[RejectedResult]:
    """All well-formed records in file order (a line cut short by a crash is skipped)."""
    return list(_records(path))


def _records(path: str) -> Iterator[RejectedResult]:
    names = {f.name for f in dataclasses.fields(RejectedResult)}
    try:
        with open(path, "rb") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return
    for raw in lines:
        try:
            data: Any = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(data, dict) or not names.issuperset(data):
            continue
        try:
            record = RejectedResult(**data)
        except TypeError:  # a required field is missing
            continue
        yield record


def iterations_to_skip(path: str) -> Set[int]:
    """Iterations whose bad result reproduced on two devices: the data (or model) is to blame."""
    return {r.iteration for r in _records(path) if r.diagnosis == "correct_result"}
