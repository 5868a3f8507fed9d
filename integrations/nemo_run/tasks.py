"""What a plugin may change in a NeMo-Run task, found before anything is changed.

Three kinds of task can be switched on: a `run.Script` (arguments are appended), a
`run.Partial` of a Megatron-style function (an argument holding a config with `ft` and
`train`, as Bridge's ConfigContainer; its `ft`, `nvrx_straggler`, ... are set), and a
`run.Partial` of a Lightning function (a `trainer` argument whose `callbacks` get ours). Any
other task is refused with the reason, so the plugin leaves the executor as it was.

A value in a Partial is either a fiddle Buildable (`run.Config(...)`, whose attributes are
its arguments) or a plain object (a dataclass instance): both are handled.
"""

import dataclasses
import enum
import inspect
from typing import Any, Dict, List, Optional, Tuple


class TaskKind(enum.Enum):
    SCRIPT = "run.Script"
    MEGATRON = "run.Partial of a Megatron-style function"
    LIGHTNING = "run.Partial of a Lightning function"


MEGATRON_FIELDS = ("ft", "train")


def classify(task: Any, run: Any, plugin: str) -> Tuple[TaskKind, Any]:
    """(kind, the object to change): the Script, the Megatron config, or the trainer."""
    if isinstance(task, run.Script):
        return TaskKind.SCRIPT, task
    if isinstance(task, run.Partial):
        for value in _arguments(task).values():
            if all(name in field_names(value) for name in MEGATRON_FIELDS):
                return TaskKind.MEGATRON, value
        trainer = _arguments(task).get("trainer")
        if trainer is not None and "callbacks" in field_names(trainer):
            return TaskKind.LIGHTNING, trainer
        raise ValueError(
            f"{plugin}: cannot switch anything on in run.Partial({_name(task)}): it has no argument holding a "
            f"config with {' and '.join(MEGATRON_FIELDS)} (Megatron-style) and no 'trainer' argument with "
            f"callbacks (Lightning); the executor was left unchanged")
    raise TypeError(f"{plugin}: expected a run.Script or run.Partial task, got {type(task).__name__}; "
                    f"the executor was left unchanged")


def field_names(value: Any) -> List[str]:
    """The fields of a Buildable's target, or of a dataclass instance / plain object."""
    target = getattr(value, "__fn_or_cls__", None)
    if target is not None:
        try:
            return list(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            return list(_arguments(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [f.name for f in dataclasses.fields(value)]
    return list(getattr(value, "__dict__", {}))


def get_field(value: Any, name: str) -> Any:
    """A field's value; None when a Buildable leaves it unset (its default then applies)."""
    if hasattr(value, "__fn_or_cls__"):
        return _arguments(value).get(name)
    return getattr(value, name, None)


def set_config(holder: Any, name: str, config_cls: type, run: Any, fields: Dict[str, Any]) -> None:
    """Make `holder.name` a `config_cls` with `fields` set, keeping whatever else it had."""
    current = get_field(holder, name)
    if current is None:
        setattr(holder, name, run.Config(config_cls, **fields) if hasattr(holder, "__fn_or_cls__")
             else config_cls(**fields))
    elif hasattr(current, "__fn_or_cls__"):
        for key, value in fields.items():
            setattr(current, key, value)
    else:
        setattr(holder, name, dataclasses.replace(current, **fields))


def set_fields(holder: Any, fields: Dict[str, Any]) -> List[str]:
    """Set those of `fields` that `holder` has; the names set."""
    known = field_names(holder)
    done = []
    for key, value in fields.items():
        if key in known:
            setattr(holder, key, value)
            done.append(key)
    return done


def merge_callbacks(trainer: Any, callbacks: List[Any]) -> List[Any]:
    """Append each callback whose class the trainer has no callback of yet; those added."""
    existing = list(get_field(trainer, "callbacks") or [])
    added = [cb for cb in callbacks if not any(_same_class(cb, old) for old in existing)]
    setattr(trainer, "callbacks", existing + added)
    return added


def _same_class(new: Any, old: Any) -> bool:
    new_cls, old_cls = _class_of(new), _class_of(old)
    return isinstance(new_cls, type) and isinstance(old_cls, type) and (
        issubclass(old_cls, new_cls) or issubclass(new_cls, old_cls))


def _class_of(value: Any) -> Optional[type]:
    return getattr(value, "__fn_or_cls__", None) or type(value)


def _arguments(buildable: Any) -> Dict[str, Any]:
    return dict(getattr(buildable, "__arguments__", {}))


def _name(task: Any) -> str:
    target = getattr(task, "__fn_or_cls__", None)
    return getattr(target, "__qualname__", repr(target))
