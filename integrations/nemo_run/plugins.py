"""NeMo-Run plugins that switch nvrx-suite on for a task and its executor.

`FaultTolerancePlugin` and `PreemptionPlugin` have Megatron-Bridge's fields, defaults and
`run.Script` behaviour (its `*PluginScriptArgs`, converters and exact argument strings), then
NeMo 2's `sig` and `callbacks`, then fields of our own, all optional. Unlike either anchor,
one plugin serves a Script, a Partial of a Megatron-style function and a Partial of a
Lightning function, and `setup` refuses any other task before it changes the executor.
`StragglerDetectionPlugin` and `InProcessRestartPlugin` (no anchor has them) take the
nvrx_megatron config they switch on.
"""

import dataclasses
import logging
import signal
from typing import Any, Callable, Dict, List, Optional, Union

from nvrx_core.config import ConfigError, check
from nvrx_core.ft.respawn_marker import LAUNCHER_POLICY_ENV
from nvrx_nemo_run import executor as ex
from nvrx_nemo_run import script_args as sa
from nvrx_nemo_run._compat import Plugin, require_nemo_run
from nvrx_nemo_run.tasks import TaskKind, classify, field_names, get_field, merge_callbacks, set_config, set_fields

logger = logging.getLogger("nvrx.nemo_run")


def _positive_or_none(value: Any, name: str) -> None:
    check(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0),
          name, value, "must be a number of seconds > 0, or None")


def _extend_script(task: Any, overrides: List[str], plugin: str) -> None:
    task.args.extend(overrides)
    logger.info("%s added CLI overrides: %s", plugin, ", ".join(overrides))


@dataclasses.dataclass(kw_only=True)
class FaultTolerancePlugin(Plugin):
    """Hang and crash detection with in-job restarts: our ft_launcher as the executor's launcher.

    Bridge's fields first. Ours: `rank_section_timeouts` ({"setup": s, "step": s,
    "checkpointing": s}) and `rank_out_of_section_timeout` (section-based detection),
    `workload_check_interval`, `finished_flag_file` (local jobs; Slurm sets its own),
    `restart_policy` ("respawn-rank": replace only a dead rank whose job runs the in-process
    Wrapper, docs/respawn.md; None: ft_launcher's default, every rank restarts).
    """

    enable_ft_package: bool = True
    calc_ft_timeouts: bool = True
    num_in_job_restarts: int = 3
    num_job_retries_on_failure: int = 2
    initial_rank_heartbeat_timeout: Optional[int] = 1800
    rank_heartbeat_timeout: Optional[int] = 300
    script_args_converter_fn: Optional[Callable[[sa.FaultTolerancePluginScriptArgs], List[str]]] = None
    rank_section_timeouts: Optional[Dict[str, Optional[float]]] = None
    rank_out_of_section_timeout: Optional[float] = None
    workload_check_interval: Optional[float] = None
    finished_flag_file: Optional[str] = None
    restart_policy: Optional[str] = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("enable_ft_package", "calc_ft_timeouts"):
            check(isinstance(getattr(self, field), bool), f"{name}.{field}", getattr(self, field),
                  "must be True or False")
        for field in ("num_in_job_restarts", "num_job_retries_on_failure"):
            value = getattr(self, field)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, f"{name}.{field}", value,
                  "must be an integer >= 0")
        for field in ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "rank_out_of_section_timeout",
                      "workload_check_interval"):
            _positive_or_none(getattr(self, field), f"{name}.{field}")
        check(self.rank_section_timeouts is None or isinstance(self.rank_section_timeouts, dict),
              f"{name}.rank_section_timeouts", self.rank_section_timeouts, "must be a dict of section -> seconds")
        check(self.restart_policy in (None, "any-failed", "respawn-rank"), "restart_policy", self.restart_policy,
              "must be None, 'any-failed' or 'respawn-rank' (ft_launcher --ft-restart-policy)")
        for section, seconds in (self.rank_section_timeouts or {}).items():
            _positive_or_none(seconds, f"{name}.rank_section_timeouts[{section!r}]")
        check(self.script_args_converter_fn is None or callable(self.script_args_converter_fn),
              f"{name}.script_args_converter_fn", self.script_args_converter_fn, "must be callable or None")
        self.ft_config()  # the core's own rules (a section timeout without sections, ...)

    def ft_config(self) -> Dict[str, Any]:
        """The fault-tolerance values ft_launcher gets from $NVRX_FT_CONFIG, checked by the core."""
        from nvrx_core.ft.config import FTConfig

        values: Dict[str, Any] = {
            "initial_rank_heartbeat_timeout": self.initial_rank_heartbeat_timeout,
            "rank_heartbeat_timeout": self.rank_heartbeat_timeout,
        }
        if self.rank_section_timeouts is not None:
            values["rank_section_timeouts"] = dict(self.rank_section_timeouts)
        if self.rank_out_of_section_timeout is not None:
            values["rank_out_of_section_timeout"] = self.rank_out_of_section_timeout
        if self.workload_check_interval is not None:
            values["workload_check_interval"] = self.workload_check_interval
        values["workload_check_interval"] = FTConfig.from_layers(None, values).workload_check_interval
        return values

    def setup(self, task: Any, executor: Any) -> None:
        run = require_nemo_run()
        name = type(self).__name__
        kind, target = classify(task, run, name)
        values = self.ft_config()
        ex.install_ft_config(executor, values)
        ex.install_finished_flag(executor, run, self.finished_flag_file)
        executor.launcher = run.FaultTolerance(
            max_restarts=self.num_in_job_restarts,
            initial_rank_heartbeat_timeout=self.initial_rank_heartbeat_timeout,
            rank_heartbeat_timeout=self.rank_heartbeat_timeout,
            # always set: with every field unset NeMo-Run passes --ignore-missing-fault-tol-cfg instead
            workload_check_interval=values["workload_check_interval"],
        )
        executor.retries = self.num_job_retries_on_failure
        if self.restart_policy is not None:  # NeMo-Run writes ft_launcher's command line: the launcher reads this
            executor.env_vars[LAUNCHER_POLICY_ENV] = self.restart_policy
        if kind is TaskKind.SCRIPT:
            converter = self.script_args_converter_fn or sa._default_fault_tolerance_converter
            _extend_script(target, list(converter(sa.FaultTolerancePluginScriptArgs(
                enable_ft_package=self.enable_ft_package, calc_ft_timeouts=self.calc_ft_timeouts))), name)
        elif kind is TaskKind.MEGATRON:
            from nvrx_megatron import FaultToleranceConfig

            set_config(target, "ft", FaultToleranceConfig, run, {"enable_ft_package": self.enable_ft_package,
                                                                 "calc_ft_timeouts": self.calc_ft_timeouts})
        elif self.enable_ft_package:
            from nvrx_lightning import NVRxFaultTolerance

            merge_callbacks(target, [run.Config(NVRxFaultTolerance, calculate_timeouts=self.calc_ft_timeouts)])


@dataclasses.dataclass(kw_only=True)
class PreemptionPlugin(Plugin):
    """Stop every rank at the same step on a preemption signal, checkpoint, and be requeued.

    Bridge's fields first, then NeMo 2's: `sig` (the signal the handler waits for and Slurm
    sends; SIGTERM) and `callbacks` (for a Lightning task; default: nvrx_lightning's
    NVRxPreemption on `sig`).
    """

    preempt_time: int = 60
    enable_exit_handler: bool = True
    enable_exit_handler_for_data_loader: bool = False
    script_args_converter_fn: Optional[Callable[[sa.PreemptionPluginScriptArgs], List[str]]] = None
    sig: Union[str, int, signal.Signals] = signal.SIGTERM
    callbacks: Optional[List[Any]] = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        check(isinstance(self.preempt_time, int) and not isinstance(self.preempt_time, bool)
              and self.preempt_time > 0, f"{name}.preempt_time", self.preempt_time, "must be an integer > 0 seconds")
        for field in ("enable_exit_handler", "enable_exit_handler_for_data_loader"):
            check(isinstance(getattr(self, field), bool), f"{name}.{field}", getattr(self, field),
                  "must be True or False")
        check(bool(self.signal_name), f"{name}.sig", self.sig, "must name a signal")  # parse_signal raises first
        check(self.callbacks is None or isinstance(self.callbacks, list), f"{name}.callbacks", self.callbacks,
              "must be a list of callback configs or None")

    @property
    def signal_name(self) -> str:
        from nvrx_core.signals import parse_signal

        return parse_signal(self.sig, f"{type(self).__name__}.sig").name

    def setup(self, task: Any, executor: Any) -> None:
        run = require_nemo_run()
        name = type(self).__name__
        kind, target = classify(task, run, name)
        if kind is TaskKind.MEGATRON and self.enable_exit_handler:
            target = get_field(target, "train")
            check(target is not None and "exit_signal_handler" in field_names(target), f"{name}: config.train",
                  target, "must be set and have exit_signal_handler (Bridge's TrainConfig) to switch the handler on")
        ex.preemption_signal(executor, run, self.signal_name, self.preempt_time)
        ex.requeue_when_preempted(executor, run)
        if not self.enable_exit_handler:
            return
        if kind is TaskKind.SCRIPT:
            converter = self.script_args_converter_fn or sa._default_preemption_converter
            _extend_script(target, list(converter(sa.PreemptionPluginScriptArgs(
                enable_exit_handler=self.enable_exit_handler,
                enable_exit_handler_for_data_loader=self.enable_exit_handler_for_data_loader))), name)
        elif kind is TaskKind.MEGATRON:
            set_fields(target, {"exit_signal_handler": True,
                                "exit_signal_handler_for_dataloader": self.enable_exit_handler_for_data_loader})
        else:
            callbacks = self.callbacks
            if callbacks is None:
                from nvrx_lightning import NVRxPreemption

                callbacks = [run.Config(NVRxPreemption, signals=[self.signal_name])]
            merge_callbacks(target, callbacks)


@dataclasses.dataclass(kw_only=True)
class _ConfigPlugin(Plugin):
    """A plugin that switches on one nvrx_megatron config: `cfg.<SECTION>` of a Megatron-style
    task, `<SECTION>.*` overrides of a Script (`enabled` and the changed fields), and what
    `lightning_callback` makes of it for a Lightning trainer."""

    CONFIG = ""
    SECTION = ""

    config: Any = None
    script_args_converter_fn: Optional[Callable[[Any], List[str]]] = None

    def __post_init__(self) -> None:
        """Take any object with Bridge's fields (Bridge's own class, ours, a namespace), read by
        name as nvrx_megatron's hooks read it; the plugin keeps its own switched-on copy."""
        import nvrx_megatron
        from nvrx_megatron.convert import bridge_fields

        fields = {}
        if self.config is not None:
            try:
                fields = bridge_fields(self.config, self.CONFIG)
            except TypeError as e:
                raise ConfigError(f"{type(self).__name__}.config: {e}") from None
        self.config = getattr(nvrx_megatron, self.CONFIG)(**{**fields, "enabled": True})

    def lightning_callback(self, run: Any) -> Any:
        raise ValueError(f"{type(self).__name__}: a Lightning task cannot take it; the executor was left unchanged")

    def script_arguments(self) -> List[str]:
        raise NotImplementedError

    def setup(self, task: Any, executor: Any) -> None:
        run = require_nemo_run()
        kind, target = classify(task, run, type(self).__name__)
        if kind is TaskKind.SCRIPT:
            _extend_script(target, self.script_arguments(), type(self).__name__)
        elif kind is TaskKind.MEGATRON:
            fields = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)}
            set_config(target, self.SECTION, type(self.config), run, fields)
        else:
            merge_callbacks(target, [self.lightning_callback(run)])


@dataclasses.dataclass(kw_only=True)
class StragglerDetectionPlugin(_ConfigPlugin):
    """Name the rank that slows everyone down (and stop, with `stop_if_detected`).

    `config`: an NVRxStragglerDetectionConfig, Bridge's or nvrx_megatron's (None: Bridge's defaults), switched
    on: set as `cfg.nvrx_straggler` of a Megatron-style task, passed as `nvrx_straggler.*`
    overrides to a Script, or as NVRxStragglerDetection's arguments to a Lightning trainer.
    """

    CONFIG = "NVRxStragglerDetectionConfig"
    SECTION = "nvrx_straggler"

    def script_arguments(self) -> List[str]:
        converter = self.script_args_converter_fn or sa._default_straggler_converter
        return list(converter(sa.StragglerDetectionPluginScriptArgs(fields=sa.changed_fields(self.config))))

    def lightning_callback(self, run: Any) -> Any:
        import inspect

        from nvrx_lightning import NVRxStragglerDetection

        accepted = inspect.signature(NVRxStragglerDetection).parameters
        fields = {k: v for k, v in sa.changed_fields(self.config).items() if k in accepted}
        return run.Config(NVRxStragglerDetection, **fields)


@dataclasses.dataclass(kw_only=True)
class InProcessRestartPlugin(_ConfigPlugin):
    """Restart a failed iteration inside the running processes (no process restart).

    `config`: an InProcessRestartConfig, Bridge's or nvrx_megatron's (None: Bridge's defaults), switched on, as
    `cfg.inprocess_restart` of a Megatron-style task or `inprocess_restart.*` overrides of a
    Script. A Lightning task is refused: nvrx_lightning has no in-process restart.
    """

    CONFIG = "InProcessRestartConfig"
    SECTION = "inprocess_restart"

    def script_arguments(self) -> List[str]:
        converter = self.script_args_converter_fn or sa._default_inprocess_converter
        return list(converter(sa.InProcessRestartPluginScriptArgs(fields=sa.changed_fields(self.config))))

    def lightning_callback(self, run: Any) -> Any:
        raise ValueError(f"{type(self).__name__}: a Lightning task cannot restart in-process (nvrx_lightning has no "
                         "in-process restart; FaultTolerancePlugin restarts its processes); the executor was left "
                         "unchanged")
