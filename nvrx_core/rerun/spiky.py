"""Spiky-loss detection against a robust baseline: the median of recent accepted losses.

A median ignores the odd earlier spike that was accepted, and a rolling window follows the
loss as it falls; the first losses (warm-up) fall too fast to form a baseline and are
skipped. A loss is spiky when it is above `factor` x the baseline (a baseline <= 0 flags
nothing: a ratio means nothing there). NaN compares with nothing, so it is never a spike
(the NaN check catches it); +Inf is above every multiple, so it is one. Neither enters the
baseline.

Two implementations of the same rule: on the host a sorted window answers with a bool;
for a tensor on an accelerator the window is a tensor on the loss's device and the answer
a 0-d bool tensor there, so checking costs no device->host sync (the machine reads all of
a step's flags back at once). Which one runs is decided as in `checks.py`.
"""

import bisect
import collections
import math
from typing import Any, List, Optional, Union

import torch

from nvrx_core.rerun.checks import host_value, uses_tensor_ops


def lower_median(sorted_values: List[float]) -> float:
    """The lower middle element: what torch.nanmedian returns, so both paths agree exactly."""
    return sorted_values[(len(sorted_values) - 1) // 2]


class SpikyLossDetector:
    def __init__(self, factor: float, window: int, warmup: int, min_samples: int, tensor_ops_on_cpu: bool = False):
        if not factor > 1 or window < 1 or warmup < 0 or not 1 <= min_samples <= window:
            raise ValueError(
                f"SpikyLossDetector(factor={factor}, window={window}, warmup={warmup}, "
                f"min_samples={min_samples}): need factor > 1, window >= 1, warmup >= 0, 1 <= min_samples <= window"
            )
        self.factor = factor
        self.window = window
        self.warmup = warmup
        self.min_samples = min_samples
        self.tensor_ops_on_cpu = tensor_ops_on_cpu
        self.observed = 0
        self._recent: collections.deque = collections.deque()  # host path: oldest first
        self._sorted: List[float] = []
        self._ring: Optional[torch.Tensor] = None  # device path: NaN marks an empty slot
        self._ring_pos: Optional[torch.Tensor] = None

    def __call__(self, loss: Union[float, torch.Tensor]) -> Union[bool, torch.Tensor]:
        """Is `loss` a spike? Records it in the baseline when it is finite and not a spike."""
        if uses_tensor_ops(loss, self.tensor_ops_on_cpu):
            return self.check_tensor(loss)
        return self.check_number(host_value(loss))

    def check_number(self, value: float) -> bool:
        self._move_to_host()
        self.observed += 1
        if self.observed <= self.warmup:
            return False
        spiky = False
        if len(self._sorted) >= self.min_samples:
            baseline = lower_median(self._sorted)
            spiky = baseline > 0 and value > self.factor * baseline
        if math.isfinite(value) and not spiky:
            if len(self._recent) == self.window:
                oldest = self._recent.popleft()
                del self._sorted[bisect.bisect_left(self._sorted, oldest)]
            self._recent.append(value)
            bisect.insort(self._sorted, value)
        return spiky

    def check_tensor(self, loss: torch.Tensor) -> torch.Tensor:
        if loss.numel() != 1:
            raise ValueError(f"spiky-loss check needs a scalar loss, got shape {tuple(loss.shape)}")
        value = loss.detach().reshape(1).to(torch.float32)
        self._move_to_device(value.device)
        self.observed += 1
        if self.observed <= self.warmup:
            return torch.zeros((), dtype=torch.bool, device=value.device)
        ring, pos = self._ring, self._ring_pos
        baseline = torch.nanmedian(ring)
        enough = (~torch.isnan(ring)).sum() >= self.min_samples
        spiky = (enough & (baseline > 0) & (value > self.factor * baseline)).reshape(())
        accept = torch.isfinite(value) & ~spiky
        ring.index_copy_(0, pos, torch.where(accept, value, ring.index_select(0, pos)))
        pos.copy_(torch.where(accept, (pos + 1) % self.window, pos))
        return spiky

    def _move_to_device(self, device: torch.device) -> None:
        if self._ring is not None and self._ring.device == device:
            return
        values = self._baseline_values()
        ring = torch.full((self.window,), math.nan, dtype=torch.float32)
        ring[: len(values)] = torch.tensor(values, dtype=torch.float32)
        self._ring = ring.to(device)
        self._ring_pos = torch.tensor([len(values) % self.window], dtype=torch.int64, device=device)
        self._recent, self._sorted = collections.deque(), []

    def _move_to_host(self) -> None:
        if self._ring is None:
            return
        values = self._baseline_values()
        self._ring = self._ring_pos = None
        self._recent = collections.deque(values)
        self._sorted = sorted(values)

    def _baseline_values(self) -> List[float]:
        """The window's losses, oldest first (reads a device ring back: checkpoint/move time only)."""
        if self._ring is None:
            return list(self._recent)
        ring = self._ring.cpu().tolist()
        pos = int(self._ring_pos.item())
        return [v for v in ring[pos:] + ring[:pos] if not math.isnan(v)]

    @property
    def baseline(self) -> Optional[float]:
        values = sorted(self._baseline_values())
        return lower_median(values) if values else None

    def state_dict(self) -> dict:
        return {"observed": self.observed, "window": self._baseline_values()}

    def load_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"spiky_loss={type(state).__name__}: must be a mapping")
        observed, window = state.get("observed"), state.get("window")
        if not isinstance(observed, int) or isinstance(observed, bool) or observed < 0:
            raise ValueError(f"spiky_loss.observed={observed!r}: must be an integer >= 0")
        if not isinstance(window, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in window
        ):
            raise ValueError(f"spiky_loss.window={window!r}: must be a list of finite numbers")
        values = [float(v) for v in window][-self.window:]
        self.observed = observed
        self._ring = self._ring_pos = None
        self._recent = collections.deque(values)
        self._sorted = sorted(values)
