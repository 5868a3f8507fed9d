"""LargeValueTracker: Megatron-LM's "unexpectedly large" rule, as a rejection function.

Megatron code validates a loss or gradient norm with
`validate_result(loss, partial(machine.is_unexpectedly_large, threshold=10, context="loss"), ...)`
and its users tuned `threshold` against this rule, so it is kept as it is, beside the
suite's own spiky-loss baseline (spiky.py, a rolling median):

- per `context`, the largest |value| among the first `num_samples` finite values is the
  reference; those values are never flagged;
- afterwards a value is flagged when |value| >= threshold x reference;
- NaN and Inf are never flagged here (the NaN check catches them) and are not sampled.

Two differences, both where Megatron's rule cannot be what a caller meant: a reference of
0 (every sample was 0) flags nothing, where Megatron flags every later value including 0;
`resample=True` starts a new reference from the next values, where Megatron restarts the
count but keeps the old maximum. The reference travels in checkpoints (state_dict).
"""

import math
from typing import Any, Dict

from nvrx_core.rerun.checks import host_value


def _check_arguments(threshold: Any, context: Any, num_samples: Any, resample: Any) -> None:
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not (
            math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold={threshold!r}: must be a finite number > 0 (a multiple of the reference)")
    if not isinstance(context, str) or not context:
        raise ValueError(f"context={context!r}: must be a non-empty string naming the value (e.g. 'loss')")
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ValueError(f"num_samples={num_samples!r}: must be an integer >= 1")
    if not isinstance(resample, bool):
        raise ValueError(f"resample={resample!r}: must be True or False")


class LargeValueTracker:
    """One reference per context; call it as a rejection function (True: unexpectedly large)."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {}
        """Values sampled so far per context (stops at num_samples)."""
        self.max_values: Dict[str, float] = {}
        """Largest |value| sampled per context: the reference once the count is reached."""

    def __call__(self, result: Any, threshold: float, context: str, num_samples: int = 100,
                 resample: bool = False) -> bool:
        _check_arguments(threshold, context, num_samples, resample)
        if hasattr(result, "numel") and result.numel() != 1:
            raise ValueError(f"result: expected a scalar, got a tensor of shape {tuple(result.shape)}")
        value = abs(host_value(result))
        if not math.isfinite(value):
            return False
        if resample or context not in self.counts:
            self.counts[context] = 0
            self.max_values[context] = 0.0
        if self.counts[context] < num_samples:
            self.counts[context] += 1
            self.max_values[context] = max(self.max_values[context], value)
            return False
        reference = self.max_values[context]
        return reference > 0 and value >= threshold * reference

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts), "max_values": dict(self.max_values)}

    def load_state_dict(self, state: Any) -> None:
        """Restore from state_dict(); validated first, so a malformed state changes nothing."""
        if not isinstance(state, dict) or set(state) != {"counts", "max_values"}:
            raise ValueError(f"large_values={state!r}: must be a mapping with 'counts' and 'max_values'")
        counts, max_values = state["counts"], state["max_values"]
        if not isinstance(counts, dict) or not isinstance(max_values, dict) or set(counts) != set(max_values):
            raise ValueError("large_values: 'counts' and 'max_values' must be mappings over the same contexts")
        for context, count in counts.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"large_values.counts[{context!r}]={count!r}: must be an integer >= 0")
            value = max_values[context]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"large_values.max_values[{context!r}]={value!r}: must be a finite number >= 0")
        self.counts = dict(counts)
        self.max_values = {k: float(v) for k, v in max_values.items()}
