"""The rerun machine's checkpoint state: what `state_dict()` writes and how `load_state_dict()` resumes.

Separate from machine.py because it is the one part of the machine that deals with another
job's state rather than this step's: it decides what survives a restart (a pending re-check
elsewhere, its microbatches, the spiky-loss baseline) and how a resumed job takes it up,
abandoning a pending rerun included. The format itself and its validation are persist.py;
the protocol (the step phases) stays in machine.py. `RerunStateMachine` inherits these
methods, so they are called on the machine as before.
"""

import logging
from typing import Any, List, Optional

from nvrx_core.rerun import report
from nvrx_core.rerun.config import RerunMode
from nvrx_core.rerun.data import RerunDataIterator
from nvrx_core.rerun.persist import FORMAT_VERSION, apply_iterator_states, parse_state_dict
from nvrx_core.rerun.states import CHECKPOINTABLE_STATES, RerunEvent, RerunState

logger = logging.getLogger("nvrx.rerun")

S, E = RerunState, RerunEvent


class CheckpointState:
    """RerunStateMachine's state_dict / load_state_dict (a mixin: it uses the machine's attributes)."""

    def state_dict(self, data_iterator: Any = None) -> dict:
        """Plain-data state for the checkpoint; between steps, or when asked to checkpoint and exit."""
        if self.state not in CHECKPOINTABLE_STATES:
            raise RuntimeError(f"state_dict() called in state {self.state.value!r}: checkpoint between steps")
        pending = self.state is S.WILL_RERUN_FROM_CHECKPOINT
        iterators = self._as_iterators(data_iterator) if data_iterator is not None else self._iterators
        if pending and data_iterator is not None and iterators != self._iterators:
            raise ValueError("state_dict(data_iterator): pass the iterator(s) the step ran with")
        return {
            "format_version": FORMAT_VERSION,
            "mode": self.mode.value,
            "state": self.state.value,
            "current_iteration": self.current_iteration,
            "same_device_restarts": self.same_device_restarts,
            "failed_call": self._failed.to_state() if pending and self._failed else None,
            "saved_state": list(self._saved) if pending else None,
            "data_iterators": [it.state_dict(include_batches=pending) if it else None for it in iterators],
            "spiky_loss": self._spiky.state_dict(),
        }

    def load_state_dict(self, state: Any, abandon_pending_rerun: bool = False) -> None:
        """Restore from a checkpoint (validated first: nothing changes if it is malformed).

        A checkpoint written to re-check a step elsewhere makes the next step that re-check.
        `abandon_pending_rerun=True` (or a mode other than validate_results) drops it instead,
        and with it the step's microbatches: the way to skip data the log blames.
        """
        if self.state is not S.NOT_RUNNING_YET:
            raise RuntimeError(f"load_state_dict() called in state {self.state.value!r}: load between steps")
        spiky = self._new_spiky_detector()
        loaded = parse_state_dict(state, self._adapters, spiky)
        if loaded.mode is not self.mode:
            logger.info("rerun: checkpoint written with rerun_mode=%s, continuing with %s", loaded.mode.value, self.mode.value)
        pending = loaded.state is S.WILL_RERUN_FROM_CHECKPOINT
        iterator_states = loaded.data_iterators
        if pending and (abandon_pending_rerun or self.mode is not RerunMode.VALIDATE_RESULTS):
            pending = False
            iterator_states = [dict(s, batches=None) if s else None for s in iterator_states]
            if loaded.failed_call is not None:
                self._record(report.PENDING_RERUN_ABANDONED, loaded.failed_call, loaded.failed_call.initial_result,
                             detail=f"not re-checked (rerun_mode={self.mode.value}, abandon_pending_rerun="
                                    f"{abandon_pending_rerun}); the step's microbatches are skipped")
        self._spiky = spiky
        # An abandoned step never completed: the next step takes its number.
        self.current_iteration = loaded.current_iteration - (loaded.state is not S.NOT_RUNNING_YET and not pending)
        self.same_device_restarts = loaded.same_device_restarts if pending else 0
        self._failed = loaded.failed_call if pending else None
        self._saved = loaded.saved_state if pending else None
        self._loaded_iterator_states = iterator_states
        self.state = S.WILL_RERUN_FROM_CHECKPOINT if pending else S.NOT_RUNNING_YET
        self._apply(E.CHECKPOINT_LOADED)

    def _load_iterator_states(self, iterators: List[Optional[RerunDataIterator]]) -> None:
        """The loaded iterator states reach the step's iterators at the first step after the load."""
        states, self._loaded_iterator_states = self._loaded_iterator_states or [], None
        apply_iterator_states(iterators, states)
