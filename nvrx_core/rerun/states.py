"""The rerun protocol as an explicit table: (state, event) -> next state.

Keeping the protocol in one table (rather than in branches spread over the machine) makes
it testable on its own and printable for the docs. The machine computes an event at each
protocol call, agreed across ranks, and asks `next_state`; a pair missing from the table
is a protocol misuse (e.g. a new step started after the machine asked to exit) and raises.
"""

import enum
from typing import Dict, Optional, Tuple

from nvrx_core.exit_codes import ExitCode


class RerunState(str, enum.Enum):
    NOT_RUNNING_YET = "not_running_yet"
    """Between steps."""
    INITIAL_RUN = "initial_run"
    """First execution of the step's forward/backward."""
    RERUNNING_IN_PLACE = "rerunning_in_place"
    """The step runs again on the same device, from the same RNG state and microbatches."""
    WILL_RERUN_FROM_CHECKPOINT = "will_rerun_from_checkpoint"
    """The suspicious result reproduced: checkpoint, exit 16, resume on another device."""
    PENDING_RERUN_FROM_CHECKPOINT = "pending_rerun_from_checkpoint"
    """A resumed job loaded that checkpoint; its next step re-checks the suspicious step."""
    RERUNNING_FROM_CHECKPOINT = "rerunning_from_checkpoint"
    """The suspicious step runs on the (hopefully different) device of the resumed job."""
    WILL_EXIT_VALIDATION_FAILED = "will_exit_validation_failed"
    """A fatal outcome: exit 17 without a new checkpoint."""


class RerunEvent(str, enum.Enum):
    BEGIN_STEP = "begin_step"
    """should_run_forward_backward() called to start a step."""
    ALL_ACCEPTED = "all_accepted"
    """End of the initial run: no rank rejected a result (or the machine is disabled)."""
    RERUN_REQUESTED = "rerun_requested"
    """End of the initial run: some rank rejected a result, or determinism stats want a second run."""
    STATS_RECORDED = "stats_recorded"
    """End of a determinism-stats rerun."""
    TRANSIENT_ERROR = "transient_error"
    """End of the in-place rerun: the rejected result did not reproduce; the check was not fatal."""
    FATAL_TRANSIENT_ERROR = "fatal_transient_error"
    """End of the in-place rerun: the rejected result did not reproduce; the check was fatal."""
    REPRODUCED = "reproduced"
    """End of the in-place rerun: the rejected result reproduced on the same device."""
    CHECKPOINT_LOADED = "checkpoint_loaded"
    """load_state_dict() restored the machine from a checkpoint."""
    SAME_DEVICE = "same_device"
    """The resumed job landed on the suspicious device again (under the limit)."""
    SAME_DEVICE_LIMIT = "same_device_limit"
    """The resumed job landed on the suspicious device again, once too often: give up."""
    PERSISTENT_ERROR = "persistent_error"
    """End of the rerun elsewhere: the result differs there, so the first device is faulty."""
    CORRECT_RESULT = "correct_result"
    """End of the rerun elsewhere: the result reproduces (application/data); the check was not fatal."""
    FATAL_CORRECT_RESULT = "fatal_correct_result"
    """End of the rerun elsewhere: the result reproduces (application/data); the check was fatal."""


S, E = RerunState, RerunEvent

TRANSITIONS: Dict[Tuple[RerunState, RerunEvent], RerunState] = {
    (S.NOT_RUNNING_YET, E.BEGIN_STEP): S.INITIAL_RUN,
    (S.NOT_RUNNING_YET, E.CHECKPOINT_LOADED): S.NOT_RUNNING_YET,
    (S.INITIAL_RUN, E.ALL_ACCEPTED): S.NOT_RUNNING_YET,
    (S.INITIAL_RUN, E.RERUN_REQUESTED): S.RERUNNING_IN_PLACE,
    (S.RERUNNING_IN_PLACE, E.STATS_RECORDED): S.NOT_RUNNING_YET,
    (S.RERUNNING_IN_PLACE, E.TRANSIENT_ERROR): S.NOT_RUNNING_YET,
    (S.RERUNNING_IN_PLACE, E.FATAL_TRANSIENT_ERROR): S.WILL_EXIT_VALIDATION_FAILED,
    (S.RERUNNING_IN_PLACE, E.REPRODUCED): S.WILL_RERUN_FROM_CHECKPOINT,
    (S.WILL_RERUN_FROM_CHECKPOINT, E.CHECKPOINT_LOADED): S.PENDING_RERUN_FROM_CHECKPOINT,
    (S.PENDING_RERUN_FROM_CHECKPOINT, E.BEGIN_STEP): S.RERUNNING_FROM_CHECKPOINT,
    (S.PENDING_RERUN_FROM_CHECKPOINT, E.SAME_DEVICE): S.WILL_RERUN_FROM_CHECKPOINT,
    (S.PENDING_RERUN_FROM_CHECKPOINT, E.SAME_DEVICE_LIMIT): S.WILL_EXIT_VALIDATION_FAILED,
    (S.RERUNNING_FROM_CHECKPOINT, E.PERSISTENT_ERROR): S.NOT_RUNNING_YET,
    (S.RERUNNING_FROM_CHECKPOINT, E.CORRECT_RESULT): S.NOT_RUNNING_YET,
    (S.RERUNNING_FROM_CHECKPOINT, E.FATAL_CORRECT_RESULT): S.WILL_EXIT_VALIDATION_FAILED,
}

# What should_checkpoint_and_exit() answers in each state where it may be called:
# (should_checkpoint, should_exit, exit_code).
EXIT_REQUESTS: Dict[RerunState, Tuple[bool, bool, ExitCode]] = {
    S.NOT_RUNNING_YET: (False, False, ExitCode.SUCCESS),
    S.WILL_RERUN_FROM_CHECKPOINT: (True, True, ExitCode.RERUN_RESUME_ELSEWHERE),
    S.WILL_EXIT_VALIDATION_FAILED: (False, True, ExitCode.RERUN_VALIDATION_FAILED),
}

# States a checkpoint of the machine may be taken in (between steps, or the exit checkpoint).
CHECKPOINTABLE_STATES = (S.NOT_RUNNING_YET, S.WILL_RERUN_FROM_CHECKPOINT)

# Outcomes that ranks vote on: every rank proposes one, the highest code wins everywhere.
# Code 0 means "nothing to report" (this rank had no rejected result).
VOTE_CODES: Dict[RerunState, Tuple[Optional[RerunEvent], ...]] = {
    S.INITIAL_RUN: (E.ALL_ACCEPTED, E.RERUN_REQUESTED),
    S.RERUNNING_IN_PLACE: (None, E.TRANSIENT_ERROR, E.REPRODUCED, E.FATAL_TRANSIENT_ERROR),
    S.PENDING_RERUN_FROM_CHECKPOINT: (E.BEGIN_STEP, E.SAME_DEVICE, E.SAME_DEVICE_LIMIT),
    S.RERUNNING_FROM_CHECKPOINT: (None, E.PERSISTENT_ERROR, E.CORRECT_RESULT, E.FATAL_CORRECT_RESULT),
}


class InvalidTransition(RuntimeError):
    """A protocol call came in a state where the protocol does not allow it."""

    def __init__(self, state: RerunState, event: RerunEvent, hint: str = ""):
        allowed = sorted(e.value for (s, e) in TRANSITIONS if s == state)
        message = f"rerun state machine: event {event.value!r} is not allowed in state {state.value!r}"
        message += f" (allowed there: {', '.join(allowed) or 'none'})"
        if hint:
            message += f"; {hint}"
        super().__init__(message)
        self.state = state
        self.event = event


def next_state(state: RerunState, event: RerunEvent, hint: str = "") -> RerunState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(state, event, hint) from None


def vote_code(state: RerunState, event: Optional[RerunEvent]) -> int:
    """The code a rank proposes for `event` in the vote that ends `state`."""
    return VOTE_CODES[state].index(event)


def voted_event(state: RerunState, code: int) -> RerunEvent:
    """The event all ranks apply once the vote ending `state` returned `code` (the max)."""
    codes = VOTE_CODES[state]
    if not 0 <= code < len(codes) or codes[code] is None:
        raise RuntimeError(f"rerun state machine: vote in state {state.value!r} returned invalid code {code}")
    return codes[code]


def format_transition_table() -> str:
    """The table as Markdown, states as rows and events as columns (docs/rerun.md embeds it)."""
    events = [e for e in RerunEvent if any(ev == e for (_, ev) in TRANSITIONS)]
    lines = ["| state \\ event | " + " | ".join(e.value for e in events) + " |"]
    lines.append("|---" * (len(events) + 1) + "|")
    for state in RerunState:
        cells = [TRANSITIONS[(state, e)].value if (state, e) in TRANSITIONS else "" for e in events]
        lines.append(f"| {state.value} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
