"""The rejected-results log: one JSON line per rejected result and per diagnosis.

Operators use it to drain a faulty GPU; training scripts use it to skip data that makes
the model produce bad results (`iterations_to_skip`). Every rank appends to the same file
with O_APPEND and one write() per line (lines of concurrent ranks do not interleave), then
fsyncs: the line that explains an exit must survive the exit.
"""

import dataclasses
import json
import os
from typing import Any, Iterator, List, Optional, Set

# Event kinds (nvrx_core.events) the machine emits.
RESULT_REJECTED = "rerun_result_rejected"
RERUN_DIAGNOSIS = "rerun_diagnosis"
RERUN_EXIT_REQUESTED = "rerun_exit_requested"
DETERMINISM_STATS = "rerun_determinism_stats"

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
