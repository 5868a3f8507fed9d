"""ft_launcher's command line and configuration: everything decided before anything starts.

Separate from launcher.py, which runs the job: this module turns argv into checked settings
(torchrun's own parser extended with the --ft-* flags in every spelling users write, the
FTConfig layers defaults < YAML < $NVRX_FT_CONFIG < flags, the agent's settings, the
rendezvous choice and its options, $NVRX_PREEMPTED_EXIT_CODE) and starts nothing: a bad
value is a ConfigError naming it, before any worker, monitor or store exists.
"""

import dataclasses
import importlib
import importlib.util
import logging
import os
import sys
import uuid
from typing import List, Optional

from torch.distributed.elastic.rendezvous import RendezvousParameters

from nvrx_core import events as ev
from nvrx_core.config import ConfigError, check
from nvrx_core.exit_codes import PREEMPTED_EXIT_CODE_ENV, ExitCode
from nvrx_core.ft.agent import AgentSettings
from nvrx_core.ft import rendezvous as barrier
from nvrx_core.ft import config_env
from nvrx_core.ft.config import CONFIG_PATH_ENV, PEER_ONLY_FIELDS, FTConfig
from nvrx_core.ft import respawn_options
from nvrx_core.ft import torchrun_options
from nvrx_core.ft.warm_start import foreign_interpreter
from nvrx_core.torch_compat import torchrun_cli

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
