"""One load attempt whose outcome every rank agrees on.

AsyncCheckpointer.load_latest and LocalCheckpointManager.load both walk back from the
newest checkpoint: each rank tries its own part, and then all ranks must take the same next
step. Return the states (every rank has its part), try another checkpoint (some rank's copy
is corrupt: an older or another copy may be whole), or raise on every rank (some rank cannot
load for another reason, which no other checkpoint cures). A rank that decided alone would
leave the others blocked in the next collective.
"""

from typing import Any, Callable, NamedTuple, Optional

from nvrx_core import collectives
from nvrx_core.checkpoint.errors import CheckpointCorruptError, CheckpointError


class Attempt(NamedTuple):
    everywhere: bool
    """Every rank has its state: the load is done."""
    state: Any
    """This rank's state (None where this rank's copy was corrupt)."""
    corrupt: Optional[CheckpointCorruptError]
    """Why this rank's copy was unusable, if it was."""


def load_everywhere(load: Callable[[], Any], group: Any, what: str) -> Attempt:
    """Run this rank's `load` and agree on the outcome (collective over `group`).

    A CheckpointCorruptError counts as "not here" and the caller goes on to another copy; any
    other CheckpointError, on any rank, is raised on every rank (naming `what` on the ranks
    that did not fail themselves).
    """
    state, corrupt, fatal = None, None, None
    try:
        state = load()
    except CheckpointCorruptError as e:
        corrupt = e
    except CheckpointError as e:
        fatal = e
    any_missing, any_fatal = collectives.all_reduce_max(
        [int(state is None), int(fatal is not None)], group)
    if any_fatal:
        raise fatal or CheckpointError(f"another rank cannot load {what}; see its log")
    return Attempt(not any_missing, state, corrupt)
