"""FTConfig: what the node monitor enforces, with nvidia-resiliency-ext's field names.

Values are layered: dataclass defaults < the `fault_tolerance:` section of a YAML file
(named by --ft-cfg-path or FAULT_TOL_CFG_PATH) < --ft-* command-line flags. The same
names are accepted in YAML and on the command line, so a config moves between them as is.

`FaultToleranceConfig` is this class under nvidia-resiliency-ext's name, with its
constructors (from_kwargs, from_yaml_file, from_args) and to_yaml_file, so code and YAML
files written for it load here unchanged (docs/migrating.md lists what differs).
"""

import dataclasses
import logging
import math
import signal
from typing import Any, Dict, Mapping, Optional, Union

from nvrx_core.config import ConfigError, build, check, load_yaml_section
from nvrx_core.durable import atomic_write_bytes
from nvrx_core.signals import parse_signal

logger = logging.getLogger("nvrx.ft")

YAML_SECTION = "fault_tolerance"
CONFIG_PATH_ENV = "FAULT_TOL_CFG_PATH"

# Fields nvidia-resiliency-ext knows that have no meaning here (NIC monitoring, its own
# health-check cadence). Accepted so existing configs and launch commands keep working.
PEER_ONLY_FIELDS = frozenset(
    {
        "node_health_check_interval",
        "restart_check_interval",
        "enable_nic_monitor",
        "pci_topo_file",
        "link_down_path_template",
        "skip_section_response",  # 0.5: ranks here never wait for the monitor's answer anyway
    }
)
# Fields nvidia-resiliency-ext 0.5 reads from its config that are launcher flags here.
LAUNCHER_FLAG_FIELDS = {"use_infra_group_rank": "--ft-use-infra-group-rank"}


def parse_timeout(value: Any, field: str) -> Optional[float]:
    """A timeout in seconds; None / 'none' / 'null' / '' mean "not enforced"."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{field}={value!r}: not a number of seconds (or None)") from None
    check(math.isfinite(seconds) and seconds > 0, field, value, "must be a positive number of seconds or None")
    return seconds


def parse_section_timeouts(value: Any, field: str = "rank_section_timeouts") -> Dict[str, Optional[float]]:
    """A mapping, or the CLI form 'setup:600,step:180,checkpointing:None'."""
    if value is None:
        return {}
    if isinstance(value, str):
        pairs = {}
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, sep, seconds = item.partition(":")
            check(bool(sep) and bool(name.strip()), field, value, "expected 'name:seconds,name:seconds'")
            pairs[name.strip()] = seconds
        value = pairs
    check(isinstance(value, Mapping), field, value, "expected a mapping of section name to seconds")
    out = {}
    for name, seconds in value.items():
        check(isinstance(name, str) and name != "", field, name, "section names must be non-empty strings")
        out[name] = parse_timeout(seconds, f"{field}[{name}]")
    return out


def parse_log_level(value: Union[str, int]) -> int:
    if isinstance(value, int):
        return value
    name = str(value).strip().upper()
    level = logging.getLevelName("DEBUG" if name == "DBG" else name)  # DBG: nvidia-resiliency-ext's spelling
    if not isinstance(level, int):
        raise ConfigError(f"log_level={value!r}: not a logging level name (DEBUG, INFO, WARNING, ...)")
    return level


@dataclasses.dataclass
class FTConfig:
    """Fault-tolerance settings enforced by the node monitor for every rank on the node."""

    workload_check_interval: float = 5.0
    """Upper bound on the monitor's sleep between deadline checks (it also wakes at each deadline)."""
    initial_rank_heartbeat_timeout: Optional[float] = 60.0 * 60.0
    """Seconds from a rank's connection to its first heartbeat (covers setup and first step)."""
    rank_heartbeat_timeout: Optional[float] = 45.0 * 60.0
    """Seconds allowed between two heartbeats."""
    rank_section_timeouts: Dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    """Per named section ('setup', 'step', 'checkpointing', ...), seconds it may stay open."""
    rank_out_of_section_timeout: Optional[float] = None
    """Seconds a rank may spend with no section open (None: not enforced)."""
    safety_factor: float = 5.0
    """calculate_and_set_timeouts() sets timeout = safety_factor x the longest interval observed."""
    min_calculated_timeout: float = 2.0
    """No calculated timeout is shorter than this: 5 x a 1 ms gap between two sections would
    otherwise kill a rank the scheduler paused for a few milliseconds on a loaded node."""
    rank_termination_signal: signal.Signals = signal.SIGKILL
    """Sent to a hung rank after its stacks were dumped."""
    stack_dump_signal: signal.Signals = signal.SIGUSR2
    """The rank's faulthandler dumps all thread stacks on this signal, into a per-rank file in the
    monitor's private directory while the rank is monitored (the monitor prints it before the
    kill), into stderr otherwise."""
    stack_dump_grace: float = 0.2
    """Least seconds between the stack-dump signal and the termination signal; longer (up to 5 s)
    while the rank has not taken the signal or not finished writing its dump (a loaded node), so
    the dump is not lost."""
    termination_grace: float = 5.0
    """If the rank survives the termination signal this long, it is sent SIGKILL."""
    num_warmup_iterations: int = 1
    """Heartbeats / section runs excluded from timeout calculation (compilation, first-step costs)."""
    log_level: int = logging.INFO

    def __post_init__(self):
        self.workload_check_interval = float(self.workload_check_interval)
        check(
            math.isfinite(self.workload_check_interval) and self.workload_check_interval > 0,
            "workload_check_interval", self.workload_check_interval, "must be a positive number of seconds",
        )
        self.initial_rank_heartbeat_timeout = parse_timeout(
            self.initial_rank_heartbeat_timeout, "initial_rank_heartbeat_timeout")
        self.rank_heartbeat_timeout = parse_timeout(self.rank_heartbeat_timeout, "rank_heartbeat_timeout")
        self.rank_section_timeouts = parse_section_timeouts(self.rank_section_timeouts)
        self.rank_out_of_section_timeout = parse_timeout(
            self.rank_out_of_section_timeout, "rank_out_of_section_timeout")
        try:
            self.safety_factor = float(self.safety_factor)
        except (TypeError, ValueError):
            raise ConfigError(f"safety_factor={self.safety_factor!r}: not a number") from None
        check(
            math.isfinite(self.safety_factor) and self.safety_factor >= 1.0,
            "safety_factor", self.safety_factor,
            "must be >= 1: below 1 the calculated timeouts would kill ranks running at their observed speed "
            "(nvidia-resiliency-ext accepts it; to hold ranks to limits tighter than what they were seen to "
            "take, set the timeouts themselves and do not calculate them)",
        )
        self.rank_termination_signal = parse_signal(self.rank_termination_signal, "rank_termination_signal")
        self.stack_dump_signal = parse_signal(self.stack_dump_signal, "stack_dump_signal")
        check(
            self.stack_dump_signal not in (signal.SIGKILL, signal.SIGSTOP),
            "stack_dump_signal", self.stack_dump_signal.name, "must be a signal a process can handle",
        )
        for name in ("stack_dump_grace", "termination_grace", "min_calculated_timeout"):
            value = float(getattr(self, name))
            check(math.isfinite(value) and value >= 0, name, value, "must be >= 0 seconds")
            setattr(self, name, value)
        check(
            isinstance(self.num_warmup_iterations, int) and self.num_warmup_iterations >= 0,
            "num_warmup_iterations", self.num_warmup_iterations, "must be an integer >= 0",
        )
        self.log_level = parse_log_level(self.log_level)

    def to_json(self) -> dict:
        """Plain JSON types (signals by name) for the monitor's command line and the client."""
        out = dataclasses.asdict(self)
        out["rank_termination_signal"] = self.rank_termination_signal.name
        out["stack_dump_signal"] = self.stack_dump_signal.name
        out["log_level"] = logging.getLevelName(self.log_level)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "FTConfig":
        return build(cls, data, source="FT config")

    @classmethod
    def from_layers(
        cls, yaml_path: Optional[str] = None, overrides: Optional[Mapping[str, Any]] = None
    ) -> "FTConfig":
        """Defaults < the YAML file's `fault_tolerance:` section < overrides (CLI flags)."""
        layers = []
        if yaml_path:
            layers.append(_drop_peer_only(load_yaml_section(yaml_path, YAML_SECTION), yaml_path))
        if overrides:
            layers.append(_drop_peer_only(dict(overrides), "command line"))
        return build(cls, *layers, source=yaml_path or "FT config")

    # ---- nvidia-resiliency-ext's constructors and writer, under its names -----------------
    @classmethod
    def from_kwargs(cls, ignore_not_recognized: bool = True, **kwargs) -> "FTConfig":
        """Code written for nvidia-resiliency-ext builds its config this way. A name that is
        no field is dropped with a warning (it silently drops it: a typo then costs a job its
        intended timeouts), or refused naming it when ignore_not_recognized is False."""
        values = _drop_peer_only(dict(kwargs), "FaultToleranceConfig.from_kwargs")
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(values.keys() - known)
        if unknown and ignore_not_recognized:
            logger.warning("FaultToleranceConfig.from_kwargs: %s not fault tolerance settings; ignored", unknown)
            values = {k: v for k, v in values.items() if k in known}
        return build(cls, values, source="FaultToleranceConfig.from_kwargs")

    @classmethod
    def from_yaml_file(cls, cfg_path: str, ignore_not_recognized: bool = True) -> "FTConfig":
        """The file's `fault_tolerance:` section (top level or nested); ConfigError (a
        ValueError, as nvidia-resiliency-ext raises) when there is none."""
        return cls.from_kwargs(ignore_not_recognized, **load_yaml_section(cfg_path, YAML_SECTION))

    @classmethod
    def from_args(cls, args: Any) -> "FTConfig":
        """From an argparse.Namespace as nvidia-resiliency-ext's launcher parses it: defaults <
        the file named by `ft_cfg_path` (one without the section counts as absent) < each
        `ft_<field>` attribute that is not None. With neither, the defaults (as in 0.5; 0.4
        raised ValueError)."""
        layers = []
        path = getattr(args, "ft_cfg_path", None)
        if path is not None:
            try:
                layers.append(load_yaml_section(path, YAML_SECTION))
            except ConfigError as e:
                if f"no '{YAML_SECTION}:' section" not in str(e):  # missing or malformed file: say so
                    raise
                logger.warning("%s; using defaults and --ft-* flags", e)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        names += sorted(PEER_ONLY_FIELDS)  # a launcher flag in the Namespace is the launcher's, not the config's
        layers.append({n: getattr(args, f"ft_{n}") for n in names if getattr(args, f"ft_{n}", None) is not None})
        layers = [_drop_peer_only(layer, path or "arguments") for layer in layers]
        return build(cls, *layers, source=path or "FaultToleranceConfig.from_args")

    def to_yaml_file(self, cfg_path: str) -> None:
        """Write `fault_tolerance:` with every field (signals and the log level by name),
        atomically: a launcher starting meanwhile reads the old file or the new one. The
        fields nvidia-resiliency-ext lacks are ones it ignores when it reads the file."""
        import yaml  # deferred: only writing a file needs it (PyYAML comes with omegaconf)

        text = yaml.safe_dump({YAML_SECTION: self.to_json()}, sort_keys=False)
        atomic_write_bytes(cfg_path, text.encode())


FaultToleranceConfig = FTConfig
"""nvidia-resiliency-ext's name for FTConfig (`from nvrx_core.ft import FaultToleranceConfig`)."""


def _drop_peer_only(values: dict, source: str) -> dict:
    for name in PEER_ONLY_FIELDS & values.keys():
        logger.warning("%s: %s is a nvidia-resiliency-ext setting with no effect here; ignored", source, name)
        values.pop(name)
    for name in LAUNCHER_FLAG_FIELDS.keys() & values.keys():
        logger.warning("%s: %s is not a config field here; ignored (pass ft_launcher %s instead)", source, name,
                       LAUNCHER_FLAG_FIELDS[name])
        values.pop(name)
    return values
