"""ft_launcher: torchrun with hang detection, in-job restarts that always work, and exit codes.

Accepts every torchrun flag (it extends torch's own argument parser) plus the flags that
nvidia-resiliency-ext and NeMo-Run users already write: --ft-<field> in dash, underscore
and legacy --ft-param- spellings, --ft-cfg-path, --ignore-missing-fault-tol-cfg,
--ft-restart-policy (respawn-rank: ft/respawn.py), --workers-stop-timeout, --term-timeout.
Every torchrun option reaches torch's agent as torchrun passes it (ft/torchrun_options.py says
where each goes). All configuration is checked before any worker starts; a bad value ends the
launcher with CONFIG_ERROR (2) and a message naming it.
"""

import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import sys
import uuid
from typing import List, Optional

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from nvrx_core import events as ev
from nvrx_core.config import ConfigError, check
from nvrx_core.exit_codes import PREEMPTED_EXIT_CODE_ENV, ExitCode, describe
from nvrx_core.ft import finished
from nvrx_core.ft.agent import AgentSettings, FaultTolerantAgent, LauncherStop
from nvrx_core.ft.agent_store import AgentStoreRendezvous
from nvrx_core.ft.client import MONITOR_SOCKET_ENV
from nvrx_core.ft.collective_trace import DEFAULT_BUFFER_ENTRIES
from nvrx_core.ft import rendezvous as barrier
from nvrx_core.ft import config_env
from nvrx_core.ft.config import CONFIG_PATH_ENV, PEER_ONLY_FIELDS, FTConfig
from nvrx_core.ft.monitor_handle import MonitorHandle
from nvrx_core.ft import respawn_options
from nvrx_core.ft.rendezvous_round import RendezvousConflictError
from nvrx_core.ft import torchrun_options
from nvrx_core.ft.warm_start import (PRELOAD, RESPAWN_PRELOAD, environment_since_server_start, foreign_interpreter,
                                     run_target, split_python_command, start_fork_server)
from nvrx_core.proc import process_start_time
from nvrx_core.torch_compat import FLIGHT_RECORDER_BUFFER_ENV, torchrun_cli

logger = logging.getLogger("nvrx.ft.launcher")

get_args_parser, config_from_args, parse_min_max_nnodes = torchrun_cli()

RESTART_POLICIES = ("any-failed", "min-healthy", "respawn-rank")
RDZV_IMPLS = ("barrier", "legacy")
INFRA_RANK_SOURCES = ("SLURM_PROCID", "GROUP_RANK")


def _ft_fields() -> List[str]:
    return [f.name for f in dataclasses.fields(FTConfig)] + sorted(PEER_ONLY_FIELDS)


def build_parser():
    parser = get_args_parser()
    parser.prog = "ft_launcher"
    parser.description = "torchrun-compatible launcher with fault tolerance (nvrx-suite)"
    group = parser.add_argument_group("fault tolerance (nvrx-suite)")
    group.add_argument("--ft-cfg-path", "--ft-cfg_path", "--fault-tol-cfg-path", dest="ft_cfg_path", default=None,
                       help=f"YAML file with a 'fault_tolerance:' section (also from ${CONFIG_PATH_ENV})")
    group.add_argument("--ignore-missing-fault-tol-cfg", action="store_true",
                       help="if the config file named does not exist, use defaults instead of failing")
    for name in _ft_fields():
        dashed = name.replace("_", "-")
        spellings = {f"--ft-{dashed}", f"--ft-{name}", f"--ft-param-{name}", f"--ft-param-{dashed}", f"--ft_param_{name}"}
        group.add_argument(*sorted(spellings), dest=f"ft_{name}", default=None, metavar="VALUE",
                           help=_ft_flag_help(name))
    group.add_argument("--ft-restart-policy", "--ft-restart_policy", "--restart-policy", "--restart_policy",
                       dest="ft_restart_policy", default=respawn_options.default_policy(os.environ),
                       choices=RESTART_POLICIES,
                       help="any-failed: restart every worker when any fails; respawn-rank: replace a dead worker "
                       "in place if it ran the in-process Wrapper, else as any-failed (min-healthy: unsupported)")
    group.add_argument("--ft-rdzv-impl", "--ft-rdzv_impl", dest="ft_rdzv_impl", default="barrier", choices=RDZV_IMPLS,
                       help="barrier: --rdzv-backend c10d runs nvrx-suite's barrier rendezvous on the c10d store "
                       "(hot spares, ranks kept across restarts); legacy: torch's own c10d rendezvous")
    group.add_argument("--ft-use-infra-group-rank", "--ft-use_infra_group_rank", "--ft_use_infra_group_rank",
                       dest="ft_use_infra_group_rank", type=_flag_value, nargs="?", const=True, default=False,
                       metavar="BOOL", help="group ranks follow the scheduler's: $SLURM_PROCID, else $GROUP_RANK, "
                       "else --node-rank; a spare inherits the lost node's rank")
    group.add_argument("--workers-stop-timeout", "--workers_stop_timeout", type=float, default=15.0,
                       help="seconds to wait for workers to exit after SIGTERM before SIGKILL (also the "
                       "grace after a forwarded stop signal, unless --term-timeout / --shutdown-timeout)")
    torchrun_options.add_arguments(group)
    respawn_options.add_arguments(group)
    group.add_argument("--max-no-progress-restarts", "--max_no_progress_restarts", type=int, default=3,
                       help="give up (exit %d) after this many consecutive restart cycles without progress; 0: never"
                       % ExitCode.NO_PROGRESS)
    group.add_argument("--health-check", action="append", default=[], metavar="MODULE:FUNC",
                       help="callable returning (healthy: bool, detail: str), run before every (re)start")
    group.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                       help="start every worker as a new `python` process instead of forking it from a "
                       "server that has already imported torch (slower restarts)")
    group.add_argument("--warm-start-preload", default="", metavar="MODULE,MODULE",
                       help="extra modules the fork server imports once for all workers (e.g. lightning)")
    group.add_argument("--events-file", default=os.environ.get(ev.EVENTS_FILE_ENV),
                       help=f"JSON-lines incident log shared with the workers (also ${ev.EVENTS_FILE_ENV})")
    return parser


_INFRA_RANK_FLAGS = ("--ft-use-infra-group-rank", "--ft-use_infra_group_rank", "--ft_use_infra_group_rank")


def attach_flag_values(argv: List[str]) -> List[str]:
    """`... --ft-use-infra-group-rank train.py`: the flag's value is optional, and argparse would
    take the training script for it (and fail on it). A bare flag not followed by a true/false
    word becomes `--ft-use-infra-group-rank=true`, as written at the end of an srun line."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in _INFRA_RANK_FLAGS:
            following = out[i + 1] if i + 1 < len(out) else None
            try:
                _flag_value(following or "")
            except ValueError:
                out[i] = f"{arg}=true"
    return out


def _flag_value(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _ft_flag_help(name: str) -> str:
    if name in PEER_ONLY_FIELDS:
        return "accepted for nvidia-resiliency-ext compatibility; no effect"
    return f"FTConfig.{name}"


def load_ft_config(args) -> FTConfig:
    """Defaults < the YAML file < $NVRX_FT_CONFIG (what a scheduler plugin sets, config_env) <
    --ft-* flags. A missing file named by --ft-cfg-path is an error; one named by
    $FAULT_TOL_CFG_PATH only a note: NeMo-Run's Slurm template exports that variable whether
    or not anything wrote the file."""
    from_env = config_env.decode(os.environ.get(config_env.FT_CONFIG_ENV, ""))
    path = args.ft_cfg_path or os.environ.get(CONFIG_PATH_ENV)
    if path and not os.path.exists(path):
        if args.ft_cfg_path and not args.ignore_missing_fault_tol_cfg:
            raise ConfigError(f"fault tolerance config {path!r} does not exist "
                              "(pass --ignore-missing-fault-tol-cfg to run with defaults)")
        (logger.info if from_env else logger.warning)(
            "fault tolerance config %s (%s) not found; using %s", path,
            "--ft-cfg-path" if args.ft_cfg_path else f"${CONFIG_PATH_ENV}",
            f"${config_env.FT_CONFIG_ENV} and --ft-* flags" if from_env else "defaults and --ft-* flags")
        path = None
    overrides = {name: getattr(args, f"ft_{name}") for name in _ft_fields() if getattr(args, f"ft_{name}") is not None}
    return FTConfig.from_layers(path, {**from_env, **overrides})


def preempted_exit_code() -> Optional[int]:
    """The code to end with instead of PREEMPTED (18), from $NVRX_PREEMPTED_EXIT_CODE.

    A scheduler template may read exit codes its own way: NeMo-Run's Slurm template counts
    every non-zero exit against the job's retries, and requeues a job that exits 0 without
    the finished flag, so a preempted job there must end 0 to be requeued, not failed."""
    value = os.environ.get(PREEMPTED_EXIT_CODE_ENV)
    if value is None or value.strip() == "":
        return None
    try:
        code = int(value)
    except ValueError:
        code = -1
    check(0 <= code <= 255, f"${PREEMPTED_EXIT_CODE_ENV}", value, "must be an exit code from 0 to 255")
    return code


def load_health_check(spec: str):
    module, _, func = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"--health-check {spec!r}: cannot load it ({e})") from None


def check_args(args) -> AgentSettings:
    check(args.ft_restart_policy in ("any-failed", "respawn-rank"), "--ft-restart-policy (or $NVRX_FT_RESTART_POLICY)",
          args.ft_restart_policy,
          "only 'any-failed' and 'respawn-rank' are supported (min-healthy needs spare nodes across a multi-node "
          "rendezvous)")
    check(args.workers_stop_timeout > 0, "--workers-stop-timeout", args.workers_stop_timeout, "must be > 0 seconds")
    check(args.max_no_progress_restarts >= 0, "--max-no-progress-restarts", args.max_no_progress_restarts,
          "must be >= 0")
    check(args.max_restarts >= 0, "--max-restarts", args.max_restarts, "must be >= 0")
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except Exception:
        raise ConfigError(f"--nnodes={args.nnodes!r}: expected N or MIN:MAX") from None
    check(0 < min_nodes <= max_nodes, "--nnodes", args.nnodes, "need 0 < min <= max")
    for module in filter(None, (m.strip() for m in args.warm_start_preload.split(","))):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"--warm-start-preload: module {module!r} is not installed")
    if not (args.no_python or args.module or os.path.exists(args.training_script)):
        raise ConfigError(f"training script {args.training_script!r} does not exist")
    if args.warm_start and foreign_interpreter() is not None:
        logger.warning("$PYTHON_EXEC=%s is not the launcher's interpreter (%s): the workers start as new "
                       "processes of it, as under --no-warm-start", foreign_interpreter(), sys.executable)
    torchrun_options.check_options(args, warm_start=warm_start_wanted(args))
    return AgentSettings(
        workers_stop_timeout=args.workers_stop_timeout,
        max_no_progress_restarts=args.max_no_progress_restarts,
        health_checks=[load_health_check(s) for s in args.health_check],
        respawn=respawn_options.policy_from_args(args, warm_start=warm_start_wanted(args)),
    )


def warm_start_wanted(args) -> bool:
    """Workers forked from the fork server: a script run through `python` (not --no-python,
    not --run-path's function in the agent itself, not another interpreter named by
    $PYTHON_EXEC), unless --no-warm-start."""
    return args.warm_start and not args.no_python and not args.run_path and foreign_interpreter() is None


def infra_group_rank(args) -> int:
    """The scheduler's rank for this node: $SLURM_PROCID, else $GROUP_RANK, else --node-rank."""
    for name in INFRA_RANK_SOURCES:
        value = os.environ.get(name)
        if value is not None:
            try:
                rank = int(value)
            except ValueError:
                rank = -1
            check(rank >= 0, f"${name}", value, "must be a rank >= 0 (--ft-use-infra-group-rank)")
            return rank
    return args.node_rank


def resolve_rendezvous(args) -> None:
    """torchrun's rule: a single node without an endpoint gets a private c10d store on a free port.
    c10d means the barrier rendezvous unless --ft-rdzv-impl legacy."""
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    single_node_default = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
    if args.standalone or (single_node_default and max_nodes == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.rdzv_backend == "c10d" and args.ft_rdzv_impl == "barrier":
        args.rdzv_backend = barrier.BACKEND
    check_barrier_options(args)


def check_barrier_options(args) -> None:
    """The barrier rendezvous' --rdzv-conf values and --ft-use-infra-group-rank, checked (and the
    infra rank passed on as a rendezvous option) before anything starts."""
    if args.rdzv_backend == barrier.BACKEND:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        conf = dict(item.split("=", 1) for item in (args.rdzv_conf or "").split(",") if "=" in item)
        barrier.BarrierSettings.from_params(RendezvousParameters(
            barrier.BACKEND, args.rdzv_endpoint, args.rdzv_id, 1, max_nodes, **conf))
    if args.ft_use_infra_group_rank:
        check(args.rdzv_backend == barrier.BACKEND, "--ft-use-infra-group-rank", True,
              "needs the barrier rendezvous (--rdzv-backend c10d or nvrx, not with --ft-rdzv-impl legacy)")
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"infra_group_rank={infra_group_rank(args)}"]))


def enable_flight_recorder(environ) -> None:
    """Workers record their collectives (torch's Flight Recorder) unless the user chose a buffer
    size: a hang report needs them to tell the rank that stopped from its waiting peers
    (nvrx_core.ft.collective_trace)."""
    if not any(environ.get(name) for name in (FLIGHT_RECORDER_BUFFER_ENV, "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        environ[FLIGHT_RECORDER_BUFFER_ENV] = str(DEFAULT_BUFFER_ENTRIES)


def launch(args, settings: AgentSettings, ft_cfg: FTConfig, events: ev.EventLog) -> int:
    config, entrypoint, entrypoint_args = config_from_args(args)
    torchrun_options.prepare_launcher(config)
    # The workers never use the rendezvous's TCPStore (each round gets the agent's fresh
    # store), so torch's c10d handler must not share it either: its sharing path publishes
    # the master address only in the first round in which a node is rank 0, and a node that
    # joins later (--nnodes 1:2) then waits for that key until the store times out.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ[torchrun_options.LAUNCHER_PID_ENV] = str(os.getpid())
    enable_flight_recorder(os.environ)
    warm = warm_start_wanted(args) and isinstance(entrypoint, str)
    if warm:
        kind, target_args = split_python_command(entrypoint_args)
        entrypoint, entrypoint_args = run_target, [kind, *target_args]  # the environment goes first, below
        config.start_method = "forkserver"
    if warm:
        extra = [m.strip() for m in args.warm_start_preload.split(",") if m.strip()]
        if settings.respawn:
            extra += RESPAWN_PRELOAD
        start_fork_server([*PRELOAD, *extra])  # a no-op when ft_launcher's command started it already
    params = torchrun_options.rendezvous_parameters(config)
    master_addr = master_port = None
    if config.rdzv_backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    barrier.register()
    inner = rdzv_registry.get_rendezvous_handler(params)
    if isinstance(inner, barrier.BarrierRendezvousHandler):
        inner.events = events
    handler = AgentStoreRendezvous(inner)
    spec = torchrun_options.worker_spec(config, entrypoint=entrypoint, args=tuple(entrypoint_args),
                                        rdzv_handler=handler, master_addr=master_addr, master_port=master_port)
    monitor = MonitorHandle(ft_cfg, events.path)
    os.environ[MONITOR_SOCKET_ENV] = monitor.socket_path
    if events.path:
        os.environ[ev.EVENTS_FILE_ENV] = events.path
    respawn_dir = respawn_options.prepare_workers_environment(os.environ) if settings.respawn else None
    if not settings.respawn:
        respawn_options.clear_workers_environment(os.environ)
    if warm:  # what the environment gained since the fork server started reaches every worker
        spec.args = (json.dumps(environment_since_server_start()), *spec.args)
    agent = FaultTolerantAgent(spec=spec, **torchrun_options.agent_options(config),
                               settings=settings, monitor=monitor, events=events)
    shutdown_rdzv = True
    try:
        agent.stop_signals.arm()  # before the first rendezvous: a hot spare waits there
        try:
            result = agent.run()
        except Exception:
            torchrun_options.record_outcome(agent, config, succeeded=False)
            raise
        torchrun_options.record_outcome(agent, config, succeeded=True)  # the run, not the workers, succeeded
        if result is None:  # rendezvous closed gracefully by another node
            return ExitCode.SUCCESS
        if not result.is_failed():
            events.emit(ev.TRAINING_FINISHED, cycle=agent.attempt)
            handler.finish()
            return ExitCode.SUCCESS
        failures = {rank: f.exitcode for rank, f in result.failures.items()}
        logger.error("workers failed with %s and no restart is left", failures)
        return ExitCode.RESTARTS_EXHAUSTED if config.max_restarts > 0 else ExitCode.FAILURE
    except LauncherStop as stop:
        logger.error("%s", stop)
        shutdown_rdzv = stop.close_rendezvous
        return stop.exit_code
    except RendezvousConflictError as e:
        logger.error("the rendezvous refused this node: %s", e)
        return ExitCode.CONFIG_ERROR
    except RendezvousError as e:
        logger.error("rendezvous failed: %s", e)
        return ExitCode.FAILURE
    except SignalException as e:
        shutdown_rdzv = False  # other nodes may still rendezvous on this run id
        stop = agent.signal_stop  # None: the signal came outside the run loop; no worker was asked
        code = stop.exit_code() if stop is not None else 128 + int(e.sigval)
        exits = stop.exit_codes if stop is not None else None
        if code == ExitCode.PREEMPTED:
            logger.warning("received %s; the workers saved and exited PREEMPTED (%s): preempted", e.sigval.name, exits)
        else:
            logger.warning("launcher received %s; workers stopped (exit codes %s)", e.sigval.name, exits)
        return code
    finally:
        agent.stop_signals.settle()
        if shutdown_rdzv:
            handler.shutdown()
        handler.stop_heartbeat()
        monitor.stop()
        respawn_options.remove_directory(respawn_dir)
        agent.stop_signals.release()


class _WithoutTraceback(logging.Filter):
    """Drop the traceback torch logs with each worker failure.

    It is always the same launcher-side ProcessExitedException (the worker's own traceback
    is in its output), and formatting it makes torch import torch._dynamo: 2 s of a
    restart spent in the launcher on the first failure.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[ft_launcher %(asctime)s] %(levelname)s %(message)s")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_WithoutTraceback())
    args = build_parser().parse_args(attach_flag_values(sys.argv[1:] if argv is None else argv))
    if finished.is_finished():
        logger.info("%s exists: the job already finished; exiting 0", finished.finished_flag_path())
        return ExitCode.SUCCESS
    os.environ[ev.LAUNCHER_ID_ENV] = ev.new_launcher_id()  # for this process's monitor and workers too
    events = ev.EventLog(args.events_file, source="launcher")
    try:
        ft_cfg = load_ft_config(args)
        settings = check_args(args)
        resolve_rendezvous(args)
        preempted_code = preempted_exit_code()
    except ConfigError as e:
        print(f"ft_launcher: error: {e}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    logging.getLogger("nvrx").setLevel(ft_cfg.log_level)
    events.emit(ev.LAUNCHER_STARTED, process_started=process_start_time(os.getpid()))
    code = launch(args, settings, ft_cfg, events)
    status = int(code)
    if code == ExitCode.PREEMPTED and preempted_code is not None:
        logger.info("preempted: exiting %d, as $%s asks", preempted_code, PREEMPTED_EXIT_CODE_ENV)
        status = preempted_code
    events.emit(ev.LAUNCHER_EXIT, exit_code=int(code), meaning=describe(code), process_exit_code=status)
    return status


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
