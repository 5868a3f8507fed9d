"""RerunDataIterator: lets a rerun see exactly the microbatches the first run saw.

A data loader cannot be asked for "the same batches again", so the wrapper keeps the
current step's microbatches (references only) and replays them on a rerun. When a step
must be re-checked in a resumed job, the microbatches themselves go into the checkpoint:
the resumed job may not be able to regenerate them (shuffling, streaming data).
"""

from typing import Any, Iterable, Iterator, List, Optional

FORMAT_VERSION = 1


class RerunDataIterator:
    """Wraps an iterator of microbatches; the machine calls advance() per step and rewind() per rerun.

    `drawn` counts the items taken from the underlying iterator over the whole run (it
    survives load_state_dict), so a resumed job can position a fresh loader after them:
    ``RerunDataIterator(itertools.islice(loader, state["drawn"], None))``.
    """

    def __init__(self, iterable: Iterable[Any]):
        self._source: Iterator[Any] = iter(iterable)
        self._step_batches: List[Any] = []
        self._replay_pos: int = 0
        self._replaying: bool = False
        self.drawn: int = 0

    def __iter__(self) -> "RerunDataIterator":
        return self

    def __next__(self) -> Any:
        if self._replaying:
            if self._replay_pos < len(self._step_batches):
                batch = self._step_batches[self._replay_pos]
                self._replay_pos += 1
                return batch
            # The rerun asks for more than the first run did: continue from the source.
            self._replaying = False
        batch = next(self._source)
        self.drawn += 1
        self._step_batches.append(batch)
        return batch

    def advance(self) -> None:
        """A new step begins: forget the previous step's microbatches."""
        self._step_batches = []
        self._replay_pos = 0
        self._replaying = False

    def rewind(self) -> None:
        """A rerun begins: hand out this step's microbatches again, in order."""
        self._replay_pos = 0
        self._replaying = True

    def state_dict(self, include_batches: bool) -> dict:
        """Plain data for a checkpoint; the step's microbatches only when a rerun must replay them."""
        return {
            "format_version": FORMAT_VERSION,
            "drawn": self.drawn,
            "batches": list(self._step_batches) if include_batches else None,
        }

    def load_state_dict(self, state: Any) -> None:
        """Restore the counter and, if the state carries microbatches, replay them first."""
        check_state_dict(state, "data_iterator")
        self.drawn = state["drawn"]
        self._step_batches = list(state["batches"]) if state["batches"] is not None else []
        self._replay_pos = 0
        self._replaying = state["batches"] is not None


def check_state_dict(state: Any, field: str) -> None:
    """Raise ValueError naming the first field of a data-iterator state that is malformed."""
    if not isinstance(state, dict):
        raise ValueError(f"{field}={type(state).__name__}: must be a mapping")
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{field}.format_version={state.get('format_version')!r}: must be {FORMAT_VERSION}")
    drawn = state.get("drawn")
    if not isinstance(drawn, int) or isinstance(drawn, bool) or drawn < 0:
        raise ValueError(f"{field}.drawn={drawn!r}: must be an integer >= 0")
    batches = state.get("batches", "missing")
    if batches is not None and not isinstance(batches, list):
        raise ValueError(f"{field}.batches={batches!r}: must be a list of microbatches or None")
    if batches is not None and len(batches) > drawn:
        raise ValueError(f"{field}.batches: holds {len(batches)} microbatches but only {drawn} were drawn")


def as_rerun_iterators(data_iterator: Any, who: str) -> List[Optional[RerunDataIterator]]:
    """None, one iterator, or a list of them (None for a pipeline stage without data), checked."""
    if data_iterator is None:
        return []
    items = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    for it in items:
        if it is not None and not isinstance(it, RerunDataIterator):
            raise TypeError(f"{who} replays microbatches: wrap the data iterator in RerunDataIterator "
                            f"(got {type(it).__name__})")
    return items
