"""What each plugin appends to a `run.Script`'s arguments.

A plugin packs its settings into a `*PluginScriptArgs` dataclass and hands it to its
`script_args_converter_fn` (default: hydra-style `section.field=value` overrides, which
Bridge's training scripts read). The two dataclasses and converters Megatron-Bridge has are
kept with its names and its exact strings (`ft.enable_ft_package=true`, but
`train.exit_signal_handler=True`: Bridge lower-cases one and not the other), so a converter
written for Bridge works here unchanged.
"""

import dataclasses
from typing import Any, Dict, List


@dataclasses.dataclass
class PreemptionPluginScriptArgs:
    """Arguments for PreemptionPlugin to pass to run.Script."""

    enable_exit_handler: bool
    enable_exit_handler_for_data_loader: bool


def _default_preemption_converter(args: PreemptionPluginScriptArgs) -> List[str]:
    return [
        f"train.exit_signal_handler={args.enable_exit_handler}",
        f"train.exit_signal_handler_for_dataloader={args.enable_exit_handler_for_data_loader}",
    ]


@dataclasses.dataclass
class FaultTolerancePluginScriptArgs:
    """Arguments for FaultTolerancePlugin to pass to run.Script."""

    enable_ft_package: bool
    calc_ft_timeouts: bool


def _default_fault_tolerance_converter(args: FaultTolerancePluginScriptArgs) -> List[str]:
    return [
        f"ft.enable_ft_package={str(args.enable_ft_package).lower()}",
        f"ft.calc_ft_timeouts={str(args.calc_ft_timeouts).lower()}",
    ]


@dataclasses.dataclass
class StragglerDetectionPluginScriptArgs:
    """Arguments for StragglerDetectionPlugin to pass to run.Script: the fields of its
    NVRxStragglerDetectionConfig that differ from the defaults (`enabled` always)."""

    fields: Dict[str, Any]


@dataclasses.dataclass
class InProcessRestartPluginScriptArgs:
    """Arguments for InProcessRestartPlugin to pass to run.Script: the fields of its
    InProcessRestartConfig that differ from the defaults (`enabled` always)."""

    fields: Dict[str, Any]


def _override(section: str, fields: Dict[str, Any]) -> List[str]:
    return [f"{section}.{name}={_hydra_value(value)}" for name, value in fields.items()]


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return str(value)


def _default_straggler_converter(args: StragglerDetectionPluginScriptArgs) -> List[str]:
    return _override("nvrx_straggler", args.fields)


def _default_inprocess_converter(args: InProcessRestartPluginScriptArgs) -> List[str]:
    return _override("inprocess_restart", args.fields)


def changed_fields(config: Any) -> Dict[str, Any]:
    """`enabled` and every field of the dataclass `config` whose value is not its default."""
    out = {"enabled": True}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name != "enabled" and f.default is not dataclasses.MISSING and value != f.default:
            out[f.name] = value
    return out
