"""Where each field of torchrun's LaunchConfig goes in ft_launcher, and the checks torchrun skips.

torchrun hands its parsed options to torch's launch_agent, which spreads them over the
WorkerSpec, the agent and the rendezvous. ft_launcher builds those objects itself (its own
agent subclass, warm start, the agent-hosted worker store), so a field that torch adds, or
one that was overlooked, would be accepted on the command line and then silently dropped.
The tables below are the one place that says where every field goes, the builders use them,
and tests/test_ft_torchrun_parity.py fails on any field of LaunchConfig, WorkerSpec or
LocalElasticAgent that is in none of them: forwarded, or a deliberate difference with its
reason (NOT_FORWARDED).

torchrun also fails late on options this machine cannot honour (NUMA binding without CUDA or
numactl, an unknown event handler): in the launcher, with a traceback, once workers are being
started. ft_launcher refuses them before anything starts, naming the flag.
"""

import math
import os
import shutil
from typing import Any, Dict, Optional

from torch.distributed.elastic import events as torch_events
from torch.distributed.elastic import metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.rendezvous import RendezvousParameters

from nvrx_core.config import ConfigError, check

SPEC_FROM_CONFIG: Dict[str, str] = {
    "role": "role",
    "local_world_size": "nproc_per_node",
    "max_restarts": "max_restarts",
    "monitor_interval": "monitor_interval",
    "local_addr": "local_addr",
    "event_log_handler": "event_log_handler",
    "numa_options": "numa_options",
    "duplicate_stdout_filters": "duplicate_stdout_filters",
    "duplicate_stderr_filters": "duplicate_stderr_filters",
    "virtual_local_rank": "virtual_local_rank",
}
"""WorkerSpec field -> the LaunchConfig field it is copied from."""

SPEC_BUILT_BY_LAUNCHER: Dict[str, str] = {
    "entrypoint": "the script, or under warm start warm_start.run_target",
    "args": "the script's arguments (warm start: the launcher's environment first)",
    "rdzv_handler": "torch's handler for the backend, wrapped so workers always use the agent's store",
    "master_addr": "from the static rendezvous endpoint, as torch's launcher does",
    "master_port": "from the static rendezvous endpoint, as torch's launcher does",
}

AGENT_FROM_CONFIG: Dict[str, str] = {
    "logs_specs": "logs_specs",
    "start_method": "start_method",
    "log_line_prefix_template": "log_line_prefix_template",
    "shutdown_timeout": "shutdown_timeout",
}
"""LocalElasticAgent parameter -> the LaunchConfig field it is given."""

AGENT_BUILT_BY_LAUNCHER: Dict[str, str] = {"spec": "the WorkerSpec above"}

RENDEZVOUS_FROM_CONFIG: Dict[str, str] = {
    "backend": "rdzv_backend",
    "endpoint": "rdzv_endpoint",
    "run_id": "run_id",
    "min_nodes": "min_nodes",
    "max_nodes": "max_nodes",
    "local_addr": "local_addr",
}
"""RendezvousParameters argument -> LaunchConfig field; rdzv_configs becomes its keyword options."""

CONFIG_USED_BY_LAUNCHER: Dict[str, str] = {
    "rdzv_configs": "the rendezvous handler's options (RendezvousParameters keywords)",
    "rdzv_timeout": "LaunchConfig itself folds it into rdzv_configs['timeout']",
    "signals_to_handle": "$TORCHELASTIC_SIGNALS_TO_HANDLE, read by torch's agent and ft_launcher's StopSignals",
    "metrics_cfg": "torch.distributed.elastic.metrics.initialize_metrics, before the agent runs",
    "event_log_handler": "also where the agent's own SUCCEEDED / FAILED event is recorded at the end",
}

NOT_FORWARDED: Dict[str, str] = {
    "WorkerSpec.fn": "deprecated alias of entrypoint (torch warns when it is set); torch's launcher "
                     "sets entrypoint too",
    "LocalElasticAgent.exit_barrier_timeout": "torchrun does not pass it either: the agent's default "
                                              "(300 s) applies under both launchers",
    "LocalElasticAgent.uninterruptible_state_timeout": "torchrun does not pass it either; the agent reads "
                                                       "$TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT itself, "
                                                       "in ft_launcher's agent subclass too",
    "LocalElasticAgent.health_check_server": "torch's launcher passes one only when a Meta-internal knob "
                                             "(justknobs 'healthcheck before rendezvous', off in open-source "
                                             "torch) is on, so None; the agent then starts the server from "
                                             "$TORCHELASTIC_HEALTH_CHECK_PORT at each worker start, in "
                                             "ft_launcher's agent subclass too",
}
"""'Owner.name' -> why ft_launcher does not forward it."""

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
LAUNCHER_PID_ENV = "NVRX_LAUNCHER_PID"
"""Set for every worker: the ft_launcher process's pid. Under warm start a worker's parent is
the fork server, so os.getppid() does not name the launcher; this does, under either start."""


def add_arguments(group) -> None:
    from torch.distributed.argparse_util import env

    group.add_argument("--term-timeout", "--term_timeout", action=env, type=float, default=None,
                       help="seconds the workers get after a stop signal the launcher forwards (and at the "
                       "launcher's end) before SIGKILL: nvidia-resiliency-ext's flag, torchrun's "
                       f"--shutdown-timeout / ${SHUTDOWN_TIMEOUT_ENV}; default --workers-stop-timeout")


def rendezvous_parameters(config) -> RendezvousParameters:
    named = {arg: getattr(config, field) for arg, field in RENDEZVOUS_FROM_CONFIG.items()}
    return RendezvousParameters(**named, **config.rdzv_configs)


def worker_spec(config, **built: Any) -> WorkerSpec:
    """`built`: exactly the fields in SPEC_BUILT_BY_LAUNCHER."""
    if set(built) != set(SPEC_BUILT_BY_LAUNCHER):
        raise TypeError(f"worker_spec needs {sorted(SPEC_BUILT_BY_LAUNCHER)}, got {sorted(built)}")
    return WorkerSpec(**{name: getattr(config, field) for name, field in SPEC_FROM_CONFIG.items()}, **built)


def agent_options(config) -> Dict[str, Any]:
    return {name: getattr(config, field) for name, field in AGENT_FROM_CONFIG.items()}


def prepare_launcher(config) -> None:
    """What torch's launcher does with the config before its agent runs."""
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))


def record_outcome(agent, config, succeeded: bool) -> None:
    """The agent's own event, as torch's launcher records it once the run is over (the
    workers' events torch's agent records itself)."""
    event = agent.get_event_succeeded() if succeeded else agent.get_event_failed()
    torch_events.record(event, config.event_log_handler)


# ---- checks, before anything starts ---------------------------------------------------------

def check_options(args, warm_start: bool, environ=os.environ) -> None:
    """The torchrun options this launcher or machine cannot honour, refused up front; and the
    one stop grace resolved into args.shutdown_timeout (see resolve_shutdown_timeout)."""
    check_event_log_handler(args.event_log_handler)
    if args.virtual_local_rank:
        check_virtual_local_rank(args.nproc_per_node, environ)
    if args.numa_binding is not None:
        check_numa_binding(args, warm_start)
    args.shutdown_timeout = resolve_shutdown_timeout(args, environ)


def check_event_log_handler(name: str) -> None:
    """torch looks the name up only when it records its first event, once workers run, and an
    unknown one then ends torchrun with a KeyError."""
    from torch.distributed.elastic.events.handlers import get_logging_handler

    try:
        get_logging_handler(name)
    except KeyError:
        raise ConfigError(f"--event-log-handler={name!r}: not an event handler registered in "
                          "torch.distributed.elastic.events.handlers (torch's own: 'null', 'console')") from None


def _local_world_size(nproc_per_node: str) -> Optional[int]:
    try:
        return int(nproc_per_node)
    except ValueError:  # gpu / cpu / auto: torch counts them later
        return None


def check_virtual_local_rank(nproc_per_node: str, environ) -> None:
    """torch gives worker n entry n of $CUDA_VISIBLE_DEVICES and raises in the launcher, at the
    first start, when there is none."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    nproc = _local_world_size(nproc_per_node)
    if visible is None or nproc is None:
        return
    devices = visible.split(",")
    check(nproc <= len(devices), "--virtual-local-rank", True,
          f"each of the {nproc} workers per node gets its own entry of CUDA_VISIBLE_DEVICES={visible!r}, "
          f"which has {len(devices)}")


def check_numa_binding(args, warm_start: bool) -> None:
    """torch binds local rank n to the CPUs of GPU n's NUMA node, with numactl: without a CUDA
    GPU per local rank or without numactl, torchrun raises in the launcher as it starts the
    first worker. The same conditions, refused before anything starts."""
    import torch

    flag = f"--numa-binding={args.numa_binding}"
    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA GPU is visible" + ("" if torch.backends.cuda.is_built()
                                                    else f" (torch {torch.__version__} is a CPU build)"))
    else:
        nproc = _local_world_size(args.nproc_per_node)
        if nproc is not None and nproc > torch.cuda.device_count():
            problems.append(f"{nproc} workers per node but {torch.cuda.device_count()} GPUs")
    if shutil.which("numactl") is None:
        problems.append("numactl is not installed")
    if problems:
        raise ConfigError(f"{flag}: torch binds local rank n to the CPUs near GPU n with numactl, and here "
                          f"{'; '.join(problems)} (torchrun fails the same way, once it starts the workers)")
    if warm_start and args.virtual_local_rank:
        raise ConfigError(f"{flag} with --virtual-local-rank needs --no-warm-start: a warm-started worker is "
                          "bound from inside, after --virtual-local-rank left it one visible GPU, and torch "
                          "then looks for GPU <local rank> among them")


def resolve_shutdown_timeout(args, environ=os.environ) -> float:
    """The seconds workers get after a stop signal the launcher forwards, and when the launcher
    ends with workers still running, before SIGKILL.

    torchrun calls it --shutdown-timeout (else $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s),
    nvidia-resiliency-ext --term-timeout (default 1800 s): one wait under two names, so either
    sets it, and two different values are refused. Given neither, ft_launcher keeps the one
    grace it always had for every stop, --workers-stop-timeout: a scheduler's preemption
    warning leaves a fixed time, and the save must fit in it whatever stopped the workers."""
    term, shutdown = args.term_timeout, args.shutdown_timeout
    for flag, value in (("--term-timeout", term), ("--shutdown-timeout", shutdown)):
        if value is not None:
            check(math.isfinite(value) and value >= 0, flag, value, "must be >= 0 seconds")
    if term is not None and shutdown is not None:
        check(term == shutdown, "--term-timeout", term,
              f"conflicts with --shutdown-timeout={shutdown!r}: both set the grace after a forwarded stop "
              "signal; give one")
    if term is not None or shutdown is not None:
        return float(term if term is not None else shutdown)
    from_env = environ.get(SHUTDOWN_TIMEOUT_ENV)
    if from_env not in (None, ""):
        try:
            seconds = float(from_env)
        except ValueError:
            seconds = -1.0
        check(math.isfinite(seconds) and seconds >= 0, f"${SHUTDOWN_TIMEOUT_ENV}", from_env, "must be >= 0 seconds")
        return seconds
    return float(args.workers_stop_timeout)
