"""What the steps each rank committed must show after in-process faults rolled training forward.

roll_forward gives every rank the state of the live rank with the newest committed step. Two
races decide which step that is, and both are legitimate:
- A survivor that a fault caught after a step's gradients were all-reduced but before its own
  optimizer step committed it is brought that step's state, so its own record skips the step:
  another rank committed it (seen under load: ranks 0 and 1 committed step 12, ranks 2 and 3
  were interrupted before theirs and went on at 13).
- A rank that committed a step and died before any survivor committed it took the step with
  it: the survivors hold the step before, and the dead rank's replacement commits the lost step
  again (seen under load: rank 2 committed step 10 and was killed, ranks 0, 1 and 3 were
  interrupted before their commit of 10, and rank 2's replacement committed 10 a second time).
What must hold: no process redid a step (a rank's step is redone only by the new process of a
rank whose process died with it), and together the ranks committed every step.
"""

from typing import Dict, List, Tuple


def check_committed_steps(records: Dict[int, List[Tuple[int, int]]], last: int) -> None:
    """`records[rank]` is the (step, pid) of every step the rank committed, in order.

    A survivor that redid a step would show it (roll_forward chose an older state than one a
    live rank held); a replacement's first step is not bounded here beyond that: the survivors'
    records and the final weights (the tests compare them to a run without a fault) show it.
    """
    for rank, record in records.items():
        assert record and record[-1][0] == last, (rank, record)
        for (step, pid), (next_step, next_pid) in zip(record, record[1:]):
            assert next_pid != pid or next_step > step, (rank, f"process {pid} redid step {next_step}", record)
    committed = {step for record in records.values() for step, _ in record}
    assert committed == set(range(1, last + 1)), sorted(set(range(1, last + 1)) - committed)
