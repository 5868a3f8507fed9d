"""How the built-in checks read a value: with tensor ops (no sync) or directly on the host.

On an accelerator, reading a value on the host is a device->host sync, so a tensor is
checked with tensor ops and the flag stays on the device until the machine's one read per
step. A CPU scalar has no sync to avoid, and reading it is the cheapest check there is
(a handful of tensor ops costs tens of microseconds on a CPU whose caches the step just
flushed). `tensor_ops_on_cpu=True` runs the accelerator path on CPU tensors: tests use it
to exercise on a CPU-only machine the exact code a GPU run takes.
"""

import math
from typing import Any

import torch


def uses_tensor_ops(value: Any, tensor_ops_on_cpu: bool) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    return tensor_ops_on_cpu or value.device.type != "cpu" or value.numel() != 1


def reject_non_finite(result: Any, tensor_ops_on_cpu: bool = False) -> Any:
    """Rejection function of the NaN check: a 0-d bool tensor (tensor ops), else a bool."""
    if uses_tensor_ops(result, tensor_ops_on_cpu):
        return ~torch.isfinite(result.detach()).all()
    return not math.isfinite(host_value(result))


def host_value(value: Any) -> float:
    """A scalar as a Python float (.item() reads a tensor without the requires_grad warning)."""
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def check_validation_arguments(rejection_func: Any, message: Any, comparison_func: Any, tolerance: Any,
                               fatal: Any) -> None:
    """validate_result's arguments, checked at the call: a wrong one would otherwise surface
    only on the rare rerun path (a string tolerance compared after a NaN), far from its cause."""
    if not callable(rejection_func):
        raise TypeError(f"rejection_func: expected a callable returning True for a bad result, "
                        f"got {type(rejection_func).__name__}")
    if not isinstance(message, str):
        raise TypeError(f"message: expected a string naming the check, got {type(message).__name__}")
    if comparison_func is not None and not callable(comparison_func):
        raise TypeError(f"comparison_func: expected a callable or None, got {type(comparison_func).__name__}")
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not tolerance >= 0:
        raise ValueError(f"tolerance={tolerance!r}: must be a number >= 0 (the largest difference that "
                         "still counts as the same result)")
    if not isinstance(fatal, bool):
        raise TypeError(f"fatal={fatal!r}: must be True or False")
