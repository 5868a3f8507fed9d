"""RerunConfig: how the rerun state machine checks results and what it injects for testing.

Field names and meanings follow Megatron-Bridge's `RerunStateMachineConfig` (and the
Megatron-LM command-line flags it mirrors) so a Megatron user's YAML section can be used as
is; the fields after `result_rejected_tracker_filename` are this suite's additions.
"""

import dataclasses
import enum
import math
from typing import Any, Mapping, Optional

from nvrx_core.config import ConfigError, build, check, load_yaml_section

SECTION = "rerun_state_machine"


class RerunMode(str, enum.Enum):
    """What the machine does with each training step."""

    DISABLED = "disabled"
    """No reruns; a rejected result is logged, and raises if the check is fatal."""

    VALIDATE_RESULTS = "validate_results"
    """A rejected result triggers the rerun protocol that tells data, transient and persistent faults apart."""

    REPORT_DETERMINISM_STATS = "report_determinism_stats"
    """Every step runs twice; the relative differences between the two runs are summarised."""


class RerunDiagnostic(str, enum.Enum):
    """The three kinds of fault an injected (or real) suspicious result can stand for."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


# Megatron-LM's --rerun-mode flag spells the stats mode "report_stats"; accept it too.
_MODE_ALIASES = {"report_stats": RerunMode.REPORT_DETERMINISM_STATS}


def _as_mode(value: Any) -> RerunMode:
    if isinstance(value, RerunMode):
        return value
    if isinstance(value, str):
        if value in _MODE_ALIASES:
            return _MODE_ALIASES[value]
        try:
            return RerunMode(value)
        except ValueError:
            pass
    known = ", ".join(m.value for m in RerunMode)
    raise ConfigError(f"rerun_mode={value!r}: must be one of {known}")


def _as_diagnostic(value: Any) -> RerunDiagnostic:
    try:
        return RerunDiagnostic(value)
    except ValueError:
        known = ", ".join(d.value for d in RerunDiagnostic)
        raise ConfigError(f"error_injection_type={value!r}: must be one of {known}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass
class RerunConfig:
    rerun_mode: RerunMode = RerunMode.DISABLED
    """disabled | validate_results | report_determinism_stats (Megatron's "report_stats" is accepted)."""

    check_for_nan_in_loss: bool = True
    """validate_loss() rejects a NaN or Inf loss (a fatal check)."""

    check_for_spiky_loss: bool = False
    """validate_loss() rejects a loss above spiky_loss_factor x the recent baseline (non-fatal)."""

    spiky_loss_factor: float = 10.0
    """A loss is spiky when it exceeds this multiple of the baseline (median of recent finite losses)."""

    error_injection_rate: int = 0
    """Inject a suspicious result once every N validations on average; 0 injects nothing."""

    error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR
    """What an injected suspicious result turns out to be: correct_result | transient_error | persistent_error."""

    result_rejected_tracker_filename: Optional[str] = None
    """JSON-lines log of rejected results (iteration, rank, host, device, diagnosis); None keeps none."""

    spiky_loss_window: int = 100
    """How many recent accepted losses form the spiky-loss baseline."""

    spiky_loss_warmup: int = 20
    """The first N losses checked are neither flagged nor part of the baseline (early loss falls fast)."""

    spiky_loss_min_samples: int = 10
    """No loss is flagged until the baseline holds at least this many losses."""

    max_same_device_restarts: int = 2
    """Times a job resumed to re-check a result may land on the suspicious device again before giving up."""

    determinism_stats_interval: int = 100
    """report_determinism_stats: gather and report the statistics every N iterations; 0 = only on request."""

    def __post_init__(self) -> None:
        self.rerun_mode = _as_mode(self.rerun_mode)
        self.error_injection_type = _as_diagnostic(self.error_injection_type)
        for name in ("check_for_nan_in_loss", "check_for_spiky_loss"):
            value = getattr(self, name)
            check(isinstance(value, bool), name, value, "must be true or false")
        factor = self.spiky_loss_factor
        check(
            isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor) and factor > 1,
            "spiky_loss_factor", factor, "must be a finite number > 1",
        )
        self.spiky_loss_factor = float(factor)
        for name, low in (
            ("error_injection_rate", 0),
            ("spiky_loss_window", 1),
            ("spiky_loss_warmup", 0),
            ("spiky_loss_min_samples", 1),
            ("max_same_device_restarts", 0),
            ("determinism_stats_interval", 0),
        ):
            value = getattr(self, name)
            check(_is_int(value) and value >= low, name, value, f"must be an integer >= {low}")
        check(
            self.spiky_loss_min_samples <= self.spiky_loss_window,
            "spiky_loss_min_samples", self.spiky_loss_min_samples,
            f"must be <= spiky_loss_window ({self.spiky_loss_window})",
        )
        path = self.result_rejected_tracker_filename
        check(
            path is None or (isinstance(path, str) and path.strip() != ""),
            "result_rejected_tracker_filename", path, "must be a non-empty path or null",
        )

    @classmethod
    def from_layers(
        cls, yaml_path: Optional[str] = None, overrides: Optional[Mapping[str, Any]] = None
    ) -> "RerunConfig":
        """Defaults < the YAML file's `rerun_state_machine:` section < overrides (e.g. CLI flags)."""
        layers = []
        source = "rerun config"
        if yaml_path is not None:
            layers.append(load_yaml_section(yaml_path, SECTION))
            source = f"{yaml_path}: {SECTION}"
        if overrides:
            layers.append(dict(overrides))
        return build(cls, *layers, source=source)


# Megatron-Bridge's name for the same dataclass.
RerunStateMachineConfig = RerunConfig
