"""The tests' shared harness: one owner for each thing tests keep needing.

- `wait_for`: poll a condition with a generous deadline (harness/waiting.py).

Tests import it by plain name (`from harness import wait_for`): conftest puts tests/ on sys.path,
and spawned rank scripts started from tests/ inherit that through PYTHONPATH where they need it.
"""

from harness.waiting import wait_for

__all__ = ["wait_for"]
