"""The fault-tolerance config in one environment variable, NVRX_FT_CONFIG.

A scheduler plugin (nvrx_nemo_run's FaultTolerancePlugin) must hand ft_launcher the whole
config, section timeouts included, without writing a file at setup: it may run on a laptop
for a remote cluster, in a dry run, or before any job directory exists. Every executor passes
environment variables to the job, so the config travels as one. NeMo-Run's Slurm template
writes `export NAME=VALUE` without quoting, so the value is a comma-separated list of
`field=value` in characters no shell treats specially:

    NVRX_FT_CONFIG=initial_rank_heartbeat_timeout=120,rank_section_timeouts.step=30,rank_out_of_section_timeout=null

`field` is an FTConfig field, `rank_section_timeouts.<section>` one section's timeout; a value
is a number, `null`, `true`/`false` or a bare word (a signal or log level name). ft_launcher
reads it after the YAML file and before its --ft-* flags (launcher_args.load_ft_config).
"""

import math
import re
from typing import Any, Dict, Mapping

from nvrx_core.config import ConfigError

FT_CONFIG_ENV = "NVRX_FT_CONFIG"
SECTIONS_FIELD = "rank_section_timeouts"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WORD = re.compile(r"[A-Za-z0-9_.:+-]+")


def encode(values: Mapping[str, Any]) -> str:
    """The variable's value for `values` (FTConfig field -> value; sections as a dict)."""
    items = []
    for name, value in values.items():
        if name == SECTIONS_FIELD and isinstance(value, Mapping):
            items += [_item(f"{SECTIONS_FIELD}.{section}", seconds) for section, seconds in value.items()]
        else:
            items.append(_item(name, value))
    return ",".join(items)


def _item(key: str, value: Any) -> str:
    if not all(_NAME.fullmatch(part) for part in key.split(".")):
        raise ConfigError(f"${FT_CONFIG_ENV}: {key!r} is not a field name (letters, digits, '_')")
    return f"{key}={_scalar(key, value)}"


def _scalar(key: str, value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"${FT_CONFIG_ENV}: {key}={value!r}: not a finite number")
        return repr(value)
    text = getattr(value, "name", value)  # a signal or other enum: its name
    if isinstance(text, str) and _WORD.fullmatch(text) and text not in ("null", "true", "false"):
        return text
    raise ConfigError(f"${FT_CONFIG_ENV}: {key}={value!r}: only numbers, null, true/false and bare words "
                      "(letters, digits, '_.:+-') can travel in an environment variable unquoted")


def decode(text: str) -> Dict[str, Any]:
    """FTConfig values from the variable's value; ConfigError naming the part it cannot read."""
    values: Dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not all(_NAME.fullmatch(part) for part in key.split(".")):
            raise ConfigError(f"${FT_CONFIG_ENV}: {item!r} is not field=value (fields separated by commas)")
        name, _, section = key.partition(".")
        if section and (name != SECTIONS_FIELD or "." in section):
            raise ConfigError(f"${FT_CONFIG_ENV}: {key!r}: only {SECTIONS_FIELD}.<section> takes a dotted name")
        value = _parse(raw)
        if section:
            values.setdefault(SECTIONS_FIELD, {})[section] = value
        else:
            values[name] = value
    return values


def _parse(raw: str) -> Any:
    if raw in ("null", "true", "false"):
        return {"null": None, "true": True, "false": False}[raw]
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
