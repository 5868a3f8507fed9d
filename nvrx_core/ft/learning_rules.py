"""When a training loop may learn its fault-tolerance timeouts, and which ones.

Learning (`RankMonitorClient.calculate_and_set_timeouts`) is a collective, so it may only run
where every rank is (a save, the clean end of training), and a timeout learned from too little
evidence kills the job later: a heartbeat timeout learned from steps alone kills the first save,
a 'setup' timeout learned on a fresh start kills the restart that loads a checkpoint. A rule
answers one question at each such moment: "learn now, leaving out these timeouts", or "not now".

Two rules, both used: `AfterFirstSave` (what nvrx_lightning has always done) and
`PerTimeoutEvidence` (Megatron-Bridge's rule: each timeout once this run saw what it spans).
"""

import dataclasses
from typing import Optional, Protocol, Tuple

SETUP, STEP, CHECKPOINTING = "setup", "step", "checkpointing"
STARTUP_TIMEOUTS = ("initial_heartbeat", SETUP)
"""What a run must have restored a checkpoint to learn: a fresh start is faster than a restart."""

BEFORE_SAVE, AFTER_SAVE, END = "before_save", "after_save", "end"
"""The moments a rule is asked at: every rank is there, so the collective cannot meet a peer
stuck elsewhere. BEFORE_SAVE: the timeouts learned then are in the checkpoint being written."""


@dataclasses.dataclass
class LoopProgress:
    """What the current run has shown: all a rule decides from."""

    steps: int = 0
    """Training steps ended in this run (this process: a restart counts from 0)."""
    saves: int = 0
    """Synchronous saves ended in this run (async finalisations are not saves)."""
    restored: bool = False
    """The run restored a persistent checkpoint (a restart's start-up was seen)."""
    async_saves: bool = False
    """Saves are finalised in the background: their section's length says little."""
    saves_expected: bool = True
    """The loop saves checkpoints at all (if not, steps alone are all the evidence there is)."""
    learned: bool = False
    """Timeouts were learned at least once in this run."""


class LearningRule(Protocol):
    def exclusions(self, moment: str, progress: LoopProgress) -> Optional[Tuple[str, ...]]:
        """The timeouts to leave out if learning now, or None: learn nothing at this moment."""


@dataclasses.dataclass(frozen=True)
class AfterFirstSave:
    """Learn once a save was seen (before the next save is written, so the checkpoint carries
    the result) and again at the clean end; the start-up timeouts only after a restore."""

    min_steps: int = 2

    def exclusions(self, moment: str, progress: LoopProgress) -> Optional[Tuple[str, ...]]:
        if moment == AFTER_SAVE or (moment == BEFORE_SAVE and progress.learned):
            return None
        saw_a_save = progress.saves > 0 or not progress.saves_expected
        if progress.steps < self.min_steps or not saw_a_save:
            return None
        return () if progress.restored else STARTUP_TIMEOUTS


@dataclasses.dataclass(frozen=True)
class PerTimeoutEvidence:
    """Megatron-Bridge's rule, after every synchronous save and at the end: 'setup' (and the
    first heartbeat) once a persistent checkpoint was loaded, 'step' after `min_steps` steps,
    'checkpointing' after a save and never with async saves, heartbeats once steps and saves
    were both seen (a gap between heartbeats may span a save), the out-of-section timeout only
    at the end, after all of those."""

    min_steps: int = 16

    def exclusions(self, moment: str, progress: LoopProgress) -> Optional[Tuple[str, ...]]:
        if moment == BEFORE_SAVE:
            return None
        excluded = []
        if not progress.restored:
            excluded += [SETUP, "initial_heartbeat"]
        steps_seen = progress.steps >= self.min_steps
        saves_seen = progress.saves > 0
        if not steps_seen:
            excluded.append(STEP)
        if not saves_seen or progress.async_saves:
            excluded.append(CHECKPOINTING)
        if not (steps_seen and saves_seen):
            excluded.append("heartbeat")
        if not (moment == END and progress.restored and steps_seen and saves_seen):
            excluded.append("out_of_section")
        return tuple(excluded)
