"""What the steps each rank committed must show after in-process faults rolled training forward.

roll_forward gives every rank the state of the rank with the newest committed step. A rank
that a fault caught after a step's gradients were all-reduced but before its own optimizer
step committed it is brought that step's state, so its own record skips the step: another
rank committed it (seen under load: ranks 0 and 1 committed step 12, ranks 2 and 3 were
interrupted before theirs and went on at 13). What must hold is that no rank redid a step and
that, together, the ranks committed every step.
"""

from typing import Dict, List


def check_committed_steps(steps_by_rank: Dict[int, List[int]], last: int) -> None:
    """Each rank's steps strictly increase (none redone) up to `last`; their union is 1..last."""
    for rank, steps in steps_by_rank.items():
        assert steps and steps == sorted(set(steps)) and steps[-1] == last, (rank, steps)
    committed = set().union(*steps_by_rank.values())
    assert committed == set(range(1, last + 1)), sorted(set(range(1, last + 1)) - committed)
