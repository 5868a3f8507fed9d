"""Config helpers shared by every feature: YAML sections via omegaconf, layered merge, checks.

Every feature config is a dataclass validated in __post_init__. Values come in three layers,
later wins: dataclass defaults < a YAML section < command-line flags.
"""

import dataclasses
from typing import Any, Mapping, Optional, Type, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or breaks a rule; the message says which."""


def check(condition: bool, field: str, value: Any, rule: str) -> None:
    """Raise ConfigError naming the field, its value and the rule it breaks."""
    if not condition:
        raise ConfigError(f"{field}={value!r}: {rule}")


def find_section(tree: Any, name: str) -> Optional[dict]:
    """The first mapping stored under key `name`, at the top level or nested anywhere."""
    if not isinstance(tree, Mapping):
        return None
    if name in tree and isinstance(tree[name], Mapping):
        return dict(tree[name])
    for value in tree.values():
        found = find_section(value, name)
        if found is not None:
            return found
    return None


def load_yaml_section(path: str, section: str) -> dict:
    """Read `section` from a YAML file (top level or nested), resolving omegaconf interpolations."""
    from omegaconf import OmegaConf  # deferred: only config loading needs it

    try:
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except Exception as e:  # yaml.YAMLError, omegaconf errors: both mean "bad file"
        raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    found = find_section(tree, section)
    if found is None:
        raise ConfigError(f"config file {path!r} has no '{section}:' section")
    return found


def build(cls: Type[T], *layers: Mapping[str, Any], source: str = "config") -> T:
    """Instantiate dataclass `cls` from layered mappings (later layers win)."""
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    merged: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if key not in known:
                raise ConfigError(
                    f"{source}: unknown field {key!r} for {cls.__name__}; "
                    f"known fields: {', '.join(sorted(known))}"
                )
            merged[key] = value
    try:
        return cls(**merged)
    except TypeError as e:
        raise ConfigError(f"{source}: {e}") from None
