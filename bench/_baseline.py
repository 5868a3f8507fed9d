"""Measuring an earlier revision of nvrx-suite in the same run as the working tree.

`--baseline REV` checks REV out into a temporary git worktree; the benchmark then runs its
job under that tree's code as well (the same commands with the job files and PYTHONPATH
pointed at it) and prints it as one more peer, `peer(main@REV)`. "No slower than before"
is then shown in one run, on one machine state, not against a figure from another day.
"""

import os
import subprocess
import sys
import tempfile
from typing import Callable, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Baseline:
    def __init__(self, rev: str):
        self.rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", rev], capture_output=True, text=True,
                                  check=True).stdout.strip()
        self.tree = os.path.join(tempfile.mkdtemp(prefix="nvrx-baseline-"), "tree")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", self.tree, self.rev],
                       capture_output=True, check=True)
        self.label = f"main@{self.rev}"

    def command(self, cmd: List[str]) -> List[str]:
        """`cmd` with this repository's files (not its interpreter) taken from the baseline tree."""
        return [arg if arg == sys.executable else arg.replace(REPO, self.tree) for arg in cmd]

    def env(self, env: dict) -> dict:
        return dict(env, PYTHONPATH=self.tree)

    def close(self) -> None:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", self.tree], capture_output=True)


def run_with_baseline(rev: Optional[str], run: Callable[[Optional[Baseline]], int]) -> int:
    """run(baseline or None), removing the baseline's worktree afterwards."""
    baseline = Baseline(rev) if rev else None
    try:
        return run(baseline)
    finally:
        if baseline is not None:
            baseline.close()
