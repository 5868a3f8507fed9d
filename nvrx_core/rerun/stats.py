"""Comparing two results, and summarising how much reruns of the same step differ.

`relative_difference` is the default comparison of validate_result: 0.0 for bit-equal
results, +inf when the two disagree on which values are NaN/Inf (a NaN that reproduces
counts as reproduced), else max|a-b| / max(|a|,|b|). For tensors it stays on the tensors'
device, so the determinism-stats mode can read a whole step's differences back at once.
"""

import math
from typing import Dict, List, Optional, Sequence, Union

import torch

Number = Union[int, float]
PERCENTILES = (50, 90, 99)


def _special_equal(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def relative_difference(initial, rerun) -> Union[float, torch.Tensor]:
    if not isinstance(initial, torch.Tensor) and not isinstance(rerun, torch.Tensor):
        a, b = float(initial), float(rerun)
        if not (math.isfinite(a) and math.isfinite(b)):
            return 0.0 if _special_equal(a, b) else math.inf
        scale = max(abs(a), abs(b))
        return abs(a - b) / scale if scale > 0 else 0.0
    a = torch.as_tensor(initial).detach()
    b = torch.as_tensor(rerun).detach()
    device = a.device if a.device.type != "cpu" else b.device
    if a.shape != b.shape:
        return torch.tensor(math.inf, dtype=torch.float64, device=device)
    dtype = torch.float32 if device.type == "mps" else torch.float64
    a, b = a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)
    finite = torch.isfinite(a) & torch.isfinite(b)
    same_special = (torch.isnan(a) & torch.isnan(b)) | (torch.isinf(a) & (a == b))
    disagree = (~(finite | same_special)).any()
    zero = torch.zeros((), dtype=dtype, device=device)
    num = torch.where(finite, (a - b).abs(), zero).amax() if a.numel() else zero
    den = torch.where(finite, torch.maximum(a.abs(), b.abs()), zero).amax() if a.numel() else zero
    rel = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), zero)
    return torch.where(disagree, torch.full_like(rel, math.inf), rel)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated q-th percentile of an ascending, non-empty sequence."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    if fraction == 0:
        return sorted_values[low]
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def summarize(values: Sequence[float]) -> dict:
    """count, p50/p90/p99 and max of a list of relative differences."""
    ordered = sorted(values)
    summary = {"count": len(ordered)}
    for q in PERCENTILES:
        summary[f"p{q}"] = percentile(ordered, q) if ordered else None
    summary["max"] = ordered[-1] if ordered else None
    return summary


class DeterminismStats:
    """Relative differences between initial run and rerun, per validation message, since the last report."""

    def __init__(self) -> None:
        self._pending: List[tuple] = []  # (message, difference) of the current step, maybe on device
        self.values: Dict[str, List[float]] = {}

    def add(self, message: str, difference: Union[float, torch.Tensor]) -> None:
        self._pending.append((message, difference))

    def end_step(self) -> None:
        """Read the step's differences back to the host: one transfer for the whole step."""
        if not self._pending:
            return
        on_device = [d for _, d in self._pending if isinstance(d, torch.Tensor)]
        read = iter(torch.stack([d.reshape(()).to(torch.float64) for d in on_device]).cpu().tolist()) if on_device else None
        for message, difference in self._pending:
            value = next(read) if isinstance(difference, torch.Tensor) else float(difference)
            self.values.setdefault(message, []).append(value)
        self._pending = []

    def take(self) -> Dict[str, List[float]]:
        """This rank's values since the last report, clearing them."""
        values, self.values = self.values, {}
        return values


def combine_ranks(per_rank: List[Dict[str, List[float]]], iteration: int) -> dict:
    """The report rank 0 logs: per message, percentiles over all ranks' values and the worst rank."""
    calls: Dict[str, dict] = {}
    for message in sorted({m for values in per_rank for m in values}):
        merged: List[float] = []
        worst_rank: Optional[int] = None
        worst = -math.inf
        for rank, values in enumerate(per_rank):
            for v in values.get(message, []):
                merged.append(v)
                if v > worst:
                    worst, worst_rank = v, rank
        calls[message] = {**summarize(merged), "max_rank": worst_rank}
    return {"iteration": iteration, "world_size": len(per_rank), "calls": calls}
