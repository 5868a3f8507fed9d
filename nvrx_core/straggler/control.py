"""Runtime control: change thresholds or switch detection off without restarting training.

Rank 0 re-reads a small YAML (or JSON) file at each report, only when its stat changed,
and ships the resulting settings to the other ranks with the report, so every rank
switches at the same step. Example file:

    enabled: true
    relative_perf_threshold: 0.7
    stop_if_detected: false

A file that does not parse or breaks a rule is reported once in the log and ignored; the
last good settings stay. Deleting the file returns to the configured settings.
"""

import dataclasses
import logging
import os
from typing import Any, Dict, Optional, Tuple

import yaml

from nvrx_core.config import ConfigError
from nvrx_core.straggler.config import StragglerConfig

CONTROL_FIELDS = (
    "enabled",
    "report_time_interval",
    "relative_perf_threshold",
    "individual_perf_threshold",
    "consecutive_reports",
    "stop_if_detected",
    "num_scores_to_print",
)


class ControlFile:
    def __init__(self, path: str, logger: logging.Logger):
        self.path = path
        self._logger = logger
        self._stamp: Optional[Tuple[int, int, int]] = None
        self._overrides: Dict[str, Any] = {}

    def _current_stamp(self) -> Optional[Tuple[int, int, int]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _parse(self) -> Dict[str, Any]:
        with open(self.path, encoding="utf-8") as f:
            tree = yaml.safe_load(f)
        if tree is None:
            return {}
        if not isinstance(tree, dict):
            raise ConfigError(f"must hold a mapping of settings, not {type(tree).__name__}")
        unknown = sorted(str(k) for k in tree if k not in CONTROL_FIELDS)
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; settable: {', '.join(CONTROL_FIELDS)}")
        return dict(tree)

    def apply(self, base: StragglerConfig) -> StragglerConfig:
        """`base` with the file's settings; the last good ones if the file is bad now."""
        stamp = self._current_stamp()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                overrides = self._parse() if stamp is not None else {}
                dataclasses.replace(base, **overrides)  # validates every value
            except FileNotFoundError:  # removed between stat and open: as if removed
                overrides = {}
            except (OSError, UnicodeDecodeError, yaml.YAMLError, ConfigError) as e:
                self._logger.error("straggler control file %s ignored, keeping the previous settings: %s", self.path, e)
                overrides = self._overrides
            if overrides != self._overrides:
                now = overrides or "as configured"
                self._logger.warning("straggler control file %s: settings now %s", self.path, now)
            self._overrides = overrides
        return dataclasses.replace(base, **self._overrides)
