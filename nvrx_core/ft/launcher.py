"""ft_launcher: torchrun with hang detection, in-job restarts that always work, and exit codes.

Accepts every torchrun flag (it extends torch's own argument parser) plus the flags that
nvidia-resiliency-ext and NeMo-Run users already write: --ft-<field> in dash, underscore
and legacy --ft-param- spellings, --ft-cfg-path, --ignore-missing-fault-tol-cfg,
--ft-restart-policy (respawn-rank: ft/respawn.py), --workers-stop-timeout, --term-timeout.
Every torchrun option reaches torch's agent as torchrun passes it (ft/torchrun_options.py says
where each goes). All configuration is checked before any worker starts (ft/launcher_args.py);
a bad value ends the launcher with CONFIG_ERROR (2) and a message naming it.
"""

import json
import logging
import os
import sys
from typing import List, Optional

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from nvrx_core import events as ev
from nvrx_core.config import ConfigError
from nvrx_core.exit_codes import PREEMPTED_EXIT_CODE_ENV, ExitCode, describe
from nvrx_core.ft import finished
from nvrx_core.ft.agent import AgentSettings, FaultTolerantAgent, LauncherStop
from nvrx_core.ft.agent_store import AgentStoreRendezvous
from nvrx_core.ft.client import MONITOR_SOCKET_ENV
from nvrx_core.ft.collective_trace import DEFAULT_BUFFER_ENTRIES
from nvrx_core.ft import rendezvous as barrier
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.launcher_args import (attach_flag_values, build_parser, check_args, config_from_args, load_ft_config,
                                         preempted_exit_code, resolve_rendezvous, warm_start_wanted)
from nvrx_core.ft.monitor_handle import MonitorHandle
from nvrx_core.ft import respawn_options
from nvrx_core.ft.rendezvous_round import RendezvousConflictError
from nvrx_core.ft import torchrun_options
from nvrx_core.ft.warm_start import (PRELOAD, RESPAWN_PRELOAD, environment_since_server_start, run_target,
                                     split_python_command, start_fork_server)
from nvrx_core.proc import process_start_time
from nvrx_core.torch_compat import FLIGHT_RECORDER_BUFFER_ENV

logger = logging.getLogger("nvrx.ft.launcher")


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
