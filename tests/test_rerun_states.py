"""The rerun protocol's transition table, checked on its own (no machine, no torch.distributed)."""

import collections
from pathlib import Path

import pytest

from nvrx_core.exit_codes import ExitCode
from nvrx_core.rerun.states import (
    CHECKPOINTABLE_STATES, EXIT_REQUESTS, TRANSITIONS, VOTE_CODES, InvalidTransition, RerunEvent, RerunState,
    format_transition_table, next_state, vote_code, voted_event,
)

S, E = RerunState, RerunEvent
DOC = Path(__file__).resolve().parents[1] / "docs" / "rerun.md"


def reachable_from(start):
    seen, queue = {start}, collections.deque([start])
    while queue:
        state = queue.popleft()
        for (s, _), target in TRANSITIONS.items():
            if s is state and target not in seen:
                seen.add(target)
                queue.append(target)
    return seen


def test_the_protocol_paths_of_the_issue():
    """Rerun in place: differs -> transient (continue / exit 17); reproduces -> checkpoint, exit 16;
    elsewhere: differs -> persistent fault; reproduces -> application/data problem."""
    def walk(*events, start=S.NOT_RUNNING_YET):
        state = start
        for event in events:
            state = next_state(state, event)
        return state

    head = (E.BEGIN_STEP, E.RERUN_REQUESTED)
    assert walk(E.BEGIN_STEP, E.ALL_ACCEPTED) is S.NOT_RUNNING_YET
    assert walk(*head, E.TRANSIENT_ERROR) is S.NOT_RUNNING_YET
    assert walk(*head, E.FATAL_TRANSIENT_ERROR) is S.WILL_EXIT_VALIDATION_FAILED
    assert walk(*head, E.REPRODUCED) is S.WILL_RERUN_FROM_CHECKPOINT
    resumed = (E.CHECKPOINT_LOADED, E.BEGIN_STEP)
    assert walk(*resumed, E.PERSISTENT_ERROR, start=S.WILL_RERUN_FROM_CHECKPOINT) is S.NOT_RUNNING_YET
    assert walk(*resumed, E.CORRECT_RESULT, start=S.WILL_RERUN_FROM_CHECKPOINT) is S.NOT_RUNNING_YET
    assert walk(*resumed, E.FATAL_CORRECT_RESULT, start=S.WILL_RERUN_FROM_CHECKPOINT) is S.WILL_EXIT_VALIDATION_FAILED
    # Landing on the suspicious device again loops back to "checkpoint and exit", bounded by the limit.
    assert walk(E.CHECKPOINT_LOADED, E.SAME_DEVICE, start=S.WILL_RERUN_FROM_CHECKPOINT) is S.WILL_RERUN_FROM_CHECKPOINT
    assert walk(E.CHECKPOINT_LOADED, E.SAME_DEVICE_LIMIT, start=S.WILL_RERUN_FROM_CHECKPOINT) is S.WILL_EXIT_VALIDATION_FAILED
    # Determinism stats: every step runs twice.
    assert walk(*head, E.STATS_RECORDED) is S.NOT_RUNNING_YET


def test_every_pair_outside_the_table_is_rejected_with_the_allowed_events():
    for state in RerunState:
        for event in RerunEvent:
            if (state, event) in TRANSITIONS:
                assert next_state(state, event) is TRANSITIONS[(state, event)]
                continue
            with pytest.raises(InvalidTransition) as info:
                next_state(state, event, hint="because")
            text = str(info.value)
            assert repr(event.value) in text and repr(state.value) in text and text.endswith("; because")
            allowed = [e.value for (s, e) in TRANSITIONS if s is state]
            assert all(a in text for a in allowed)


def test_every_state_is_reachable_and_only_the_fatal_exit_is_terminal():
    assert reachable_from(S.NOT_RUNNING_YET) | {S.PENDING_RERUN_FROM_CHECKPOINT} >= set(RerunState)
    # A resumed job enters through CHECKPOINT_LOADED; from there everything is reachable too.
    assert reachable_from(S.WILL_RERUN_FROM_CHECKPOINT) >= {S.RERUNNING_FROM_CHECKPOINT, S.NOT_RUNNING_YET}
    terminal = {s for s in RerunState if not any(src is s for (src, _) in TRANSITIONS)}
    assert terminal == {S.WILL_EXIT_VALIDATION_FAILED}


def test_every_end_of_run_lands_where_should_checkpoint_and_exit_may_be_asked():
    """After should_run_forward_backward() returns False the loop asks should_checkpoint_and_exit()."""
    loop_states = {S.INITIAL_RUN, S.RERUNNING_IN_PLACE, S.RERUNNING_FROM_CHECKPOINT, S.PENDING_RERUN_FROM_CHECKPOINT}
    for (state, event), target in TRANSITIONS.items():
        if state in loop_states and target not in loop_states:
            assert target in EXIT_REQUESTS, (state, event, target)
    assert EXIT_REQUESTS[S.NOT_RUNNING_YET] == (False, False, ExitCode.SUCCESS)
    assert EXIT_REQUESTS[S.WILL_RERUN_FROM_CHECKPOINT] == (True, True, ExitCode.RERUN_RESUME_ELSEWHERE)
    assert EXIT_REQUESTS[S.WILL_EXIT_VALIDATION_FAILED] == (False, True, ExitCode.RERUN_VALIDATION_FAILED)
    assert int(ExitCode.RERUN_RESUME_ELSEWHERE) == 16 and int(ExitCode.RERUN_VALIDATION_FAILED) == 17
    assert set(CHECKPOINTABLE_STATES) == {S.NOT_RUNNING_YET, S.WILL_RERUN_FROM_CHECKPOINT}


def test_votes_only_produce_events_of_their_state_and_the_most_severe_wins():
    for state, events in VOTE_CODES.items():
        for event in events:
            if event is not None and event is not E.BEGIN_STEP:
                assert (state, event) in TRANSITIONS
    assert (S.PENDING_RERUN_FROM_CHECKPOINT, E.BEGIN_STEP) in TRANSITIONS
    order = [vote_code(S.RERUNNING_IN_PLACE, e) for e in (E.TRANSIENT_ERROR, E.REPRODUCED, E.FATAL_TRANSIENT_ERROR)]
    assert order == sorted(order)  # a fatal outcome anywhere beats a reproduction elsewhere
    order = [vote_code(S.RERUNNING_FROM_CHECKPOINT, e) for e in (E.PERSISTENT_ERROR, E.CORRECT_RESULT, E.FATAL_CORRECT_RESULT)]
    assert order == sorted(order)
    assert voted_event(S.INITIAL_RUN, max(0, vote_code(S.INITIAL_RUN, E.RERUN_REQUESTED))) is E.RERUN_REQUESTED
    with pytest.raises(RuntimeError, match="invalid code 0"):
        voted_event(S.RERUNNING_IN_PLACE, 0)  # some rank must have had something to rerun
    with pytest.raises(RuntimeError, match="invalid code 7"):
        voted_event(S.INITIAL_RUN, 7)


def test_formatted_table_has_every_state_and_is_the_one_in_the_docs():
    table = format_transition_table()
    rows = table.splitlines()
    assert len(rows) == 2 + len(RerunState)
    assert rows[0].count("|") - 1 == 1 + len({e for (_, e) in TRANSITIONS})
    for (state, event), target in TRANSITIONS.items():
        row = next(r for r in rows if r.startswith(f"| {state.value} |"))
        header = [c.strip() for c in rows[0].strip("|").split("|")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[header.index(event.value)] == target.value
    assert table in DOC.read_text(), "docs/rerun.md must embed format_transition_table() verbatim"
