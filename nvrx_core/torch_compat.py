"""The torch APIs nvrx-suite uses that torch does not promise to keep, in one place.

ft_launcher extends torchrun and torch.distributed.elastic through names that are not
public API: torchrun's argument parser and config builder, the elastic agent's protected
hooks that FaultTolerantAgent overrides, the attribute through which that agent counts its
restarts, the processes of its workers (and, under respawn-rank, the process context through
which one dead worker is replaced in place). The in-process Wrapper lists every process group
through c10d's private registry, and its abort imitates gloo's pair handshake on the wire (no
name to check there: it is checked against the torch versions it was verified with). The
collectives helper reads a tensor's C++ reference count to know when gloo's thread has let go
of it. A torch release may rename or drop any of them; the symptom would then be a launcher
that silently stops restarting, an abort that does nothing, or ranks that name their next
process group differently and hang. Every such use goes through this module, which checks the
name (or the version) when it is first needed and raises TorchCompatError naming the torch
version, the missing name and the versions nvrx-suite was tested with.
"""

import dataclasses
import inspect
import logging
import os
import socket
import struct
import tempfile
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

TESTED_TORCH_VERSIONS = ("2.13.0", "2.14.1")
"""`make test` runs on the first (CI), `make compat` on the newest installable here."""

logger = logging.getLogger("nvrx.torch_compat")

AGENT_HOOKS = (
    "_initialize_workers", "_rendezvous", "_start_workers", "_monitor_workers",
    "_restart_workers", "_stop_workers", "_shutdown", "_invoke_run",
)
"""The protected methods of torch's LocalElasticAgent that FaultTolerantAgent overrides.
If torch stops calling one, ours would silently never run: each must still exist."""

AGENT_RESTARTS_LEFT = "_remaining_restarts"
"""SimpleElasticAgent's count of restarts left (set in its __init__)."""


class TorchCompatError(RuntimeError):
    """A torch name nvrx-suite relies on is missing from the installed torch."""

    def __init__(self, name: str, purpose: str, version: Optional[str] = None):
        super().__init__(
            f"torch {version or torch.__version__} has no {name} ({purpose}); nvrx-suite was tested with torch "
            f"{', '.join(TESTED_TORCH_VERSIONS)}: install one of those, or report this with the torch version"
        )


def require(owner: Any, attribute: str, purpose: str) -> Any:
    """`owner.attribute`, or TorchCompatError naming it."""
    try:
        return getattr(owner, attribute)
    except AttributeError:
        name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", type(owner).__name__)
        raise TorchCompatError(f"{name}.{attribute}", purpose) from None


def require_all(owner: Any, attributes: Iterable[str], purpose: str) -> None:
    for attribute in attributes:
        require(owner, attribute, purpose)


def torch_release(version: str) -> str:
    """"2.13.0" of "2.13.0+cpu": the release, without the build's local label."""
    return str(version).split("+", 1)[0]


def require_tested_release(what: str, purpose: str, version: Optional[str] = None) -> None:
    """For a torch behaviour no name can be checked for: TorchCompatError unless the installed
    torch (`version`, default torch.__version__) is a release in TESTED_TORCH_VERSIONS."""
    version = str(torch.__version__ if version is None else version)
    if torch_release(version) not in TESTED_TORCH_VERSIONS:
        raise TorchCompatError(f"{what} verified to work", purpose, version)


# ---- torchrun -----------------------------------------------------------------------------

def torchrun_cli() -> tuple:
    """(get_args_parser, config_from_args, parse_min_max_nnodes) of torch.distributed.run:
    ft_launcher accepts every torchrun flag by extending torchrun's own parser."""
    from torch.distributed import run

    purpose = "torchrun's command line, which ft_launcher extends"
    return tuple(require(run, name, purpose) for name in ("get_args_parser", "config_from_args", "parse_min_max_nnodes"))


# ---- the elastic agent ----------------------------------------------------------------------

def check_agent_hooks(agent_class: type) -> None:
    """Fail at import, not mid-job, if torch's agent lost a hook that `agent_class` overrides."""
    for base in agent_class.__mro__[1:]:
        if base.__module__.startswith("torch."):
            require_all(base, AGENT_HOOKS, "an elastic agent hook FaultTolerantAgent overrides")
            return
    raise TorchCompatError("LocalElasticAgent", f"{agent_class.__name__} must derive from torch's agent")


def restarts_left(agent: Any) -> int:
    return require(agent, AGENT_RESTARTS_LEFT, "the elastic agent's count of restarts left")


def worker_exits(agent: Any) -> Dict[int, Tuple[int, Optional[int]]]:
    """{local rank: (pid, exit code or None while running; -N: killed by signal N)} of a
    LocalElasticAgent's workers, read from its process context: torch's own poll reports only
    failures, and of a warm start's (multiprocessing) workers only the first. Used when that
    poll could not say which worker failed how, and after a stop signal, for every worker."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, SubprocessContext

    purpose = "the elastic agent's worker processes and their exit codes"
    pcontext = require(agent, "_pcontext", purpose)
    if isinstance(pcontext, SubprocessContext):  # a script entrypoint: one Popen per worker
        handlers = require(pcontext, "subprocess_handlers", purpose)
        return {local_rank: (h.proc.pid, h.proc.poll()) for local_rank, h in handlers.items()}
    if not isinstance(pcontext, MultiprocessContext):  # None: no worker started yet
        return {}
    started = require(pcontext, "_pc", purpose)
    if started is None:
        return {}
    return {local_rank: (p.pid, p.exitcode) for local_rank, p in enumerate(require(started, "processes", purpose))}


# ---- one worker replaced in place (nvrx_core.ft.respawn) ------------------------------------

ELASTIC_WRAP_PARAMETERS = ("local_rank", "fn", "args", "envs", "stdout_redirects", "stderr_redirects", "ret_vals",
                           "queue_finished_reading_event", "numa_options")
"""What torch.distributed.elastic's `_wrap` (a warm start's worker body) takes, in order."""
SPAWN_WRAP_PARAMETERS = ("fn", "i", "args", "error_file")
"""What torch.multiprocessing's `_wrap` (the process target around it) takes, in order."""
_RESPAWN = "replacing one dead worker in place (--ft-restart-policy respawn-rank)"


def _wrap_functions() -> Tuple[Callable, Callable]:
    """(torch.multiprocessing.spawn._wrap, torch.distributed.elastic.multiprocessing.api._wrap),
    checked to take what torch's own start passes them."""
    import importlib

    from torch.distributed.elastic.multiprocessing import api

    spawn = importlib.import_module("torch.multiprocessing.spawn")  # the package's `spawn` is a function
    found = []
    for module, expected in ((spawn, SPAWN_WRAP_PARAMETERS), (api, ELASTIC_WRAP_PARAMETERS)):
        wrap = require(module, "_wrap", _RESPAWN)
        takes = tuple(inspect.signature(wrap).parameters)
        if takes != expected:
            raise TorchCompatError(f"{module.__name__}._wrap{expected} (its _wrap takes {takes})", _RESPAWN)
        found.append(wrap)
    return found[0], found[1]


def check_worker_respawn() -> None:
    """Fail at import of nvrx_core.ft.respawn, not at a worker's death, if the functions a
    replacement runs changed."""
    _wrap_functions()


@dataclasses.dataclass
class WorkerProcesses:
    """A warm start's workers, as torch's MultiprocessContext holds them: the live objects that
    replacing one worker changes, and what starting one as torch did takes."""

    processes: list
    """ProcessContext.processes: the worker process of each local rank (index)."""
    sentinels: dict
    """ProcessContext.sentinels {sentinel: local rank}: the workers torch's poll still waits on."""
    error_files: list
    """ProcessContext.error_files: where each worker's process target writes its traceback."""
    ret_vals: dict
    """{local rank: SimpleQueue}: each worker's return value (torch's poll reads them)."""
    returned: dict
    """{local rank: value}: the return values torch's poll collected already."""
    context: Any
    """The multiprocessing context the workers came from (the warm fork server)."""
    entrypoint: Callable
    args: dict
    envs: dict
    stdouts: dict
    stderrs: dict
    finished: Any
    """The event a worker waits on after returning, until every worker returned."""
    numa_options: Any


def worker_processes(agent: Any) -> WorkerProcesses:
    """The running workers of a LocalElasticAgent that started them as functions (warm start)."""
    import multiprocessing

    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    pcontext = require(agent, "_pcontext", _RESPAWN)
    if not isinstance(pcontext, MultiprocessContext):
        raise TorchCompatError(f"MultiprocessContext workers (got {type(pcontext).__name__})",
                               _RESPAWN + ": needs the warm fork server's workers")
    started = require(pcontext, "_pc", _RESPAWN)
    if started is None:
        raise TorchCompatError("MultiprocessContext._pc (the started processes)", _RESPAWN)
    return WorkerProcesses(
        processes=require(started, "processes", _RESPAWN), sentinels=require(started, "sentinels", _RESPAWN),
        error_files=require(started, "error_files", _RESPAWN), ret_vals=require(pcontext, "_ret_vals", _RESPAWN),
        returned=require(pcontext, "_return_values", _RESPAWN),
        context=multiprocessing.get_context(require(pcontext, "start_method", _RESPAWN)),
        entrypoint=pcontext.entrypoint, args=pcontext.args, envs=pcontext.envs, stdouts=pcontext.stdouts,
        stderrs=pcontext.stderrs, finished=require(pcontext, "_worker_finished_event", _RESPAWN),
        numa_options=require(pcontext, "_numa_options", _RESPAWN))


def start_worker_process(workers: WorkerProcesses, local_rank: int, envs: Dict[int, Dict[str, str]]) -> Tuple[Any, str]:
    """Start a new process for `local_rank` as torch started the first (the same targets and
    arguments, from the same fork server) with `envs` for torch's per-worker variables, and
    a fresh return-value queue and traceback file: (process, traceback file). Installing it
    in place of the dead one is the caller's (nvrx_core.ft.respawn)."""
    spawn_wrap, elastic_wrap = _wrap_functions()
    fd, error_file = tempfile.mkstemp(prefix="pytorch-errorfile-", suffix=".pickle")
    os.close(fd)
    os.unlink(error_file)  # torch's rule: the file exists only if the worker raised
    workers.ret_vals[local_rank] = workers.context.SimpleQueue()
    # torch's worker body reads its own rank's entry of each: the other ranks' queues would be
    # sent to the new process too, each descriptor through the fork server's resource sharer
    def own(table: Dict[int, Any]) -> Dict[int, Any]:
        return {local_rank: table[local_rank]}

    body = (workers.entrypoint, own(workers.args), own(envs), own(workers.stdouts), own(workers.stderrs),
            own(workers.ret_vals), workers.finished, workers.numa_options)
    process = workers.context.Process(target=spawn_wrap, args=(elastic_wrap, local_rank, body, error_file),
                                      daemon=False)
    process.start()
    return process, error_file


# ---- c10d ----------------------------------------------------------------------------------

def _c10d_world() -> Any:
    import torch.distributed as dist

    return require(dist.distributed_c10d, "_world", "c10d's registry of process groups")


def all_process_groups() -> List[Any]:
    """Every live process group; no public API lists the subgroups."""
    return list(require(_c10d_world(), "pg_map", "c10d's map of live process groups").keys())


def reset_group_counter() -> None:
    """Name the next unnamed process group "0" again (c10d counts them per process; see
    nvrx_core.inprocess.abort.reset_group_names for why ranks must agree on it)."""
    world = _c10d_world()
    require(world, "group_count", "c10d's counter naming unnamed process groups")
    world.group_count = 0


# ---- gloo's pair handshake (the in-process abort) -------------------------------------------

_GLOO_HANDSHAKE = "gloo's pair handshake"
_GLOO_HANDSHAKE_PURPOSE = "the in-process abort imitates it to end a gloo group's wait for a peer that gave up"
GLOO_SEQUENCE_FORMAT = "=q"
"""A pair's sequence number as gloo's listener reads it off a new connection: 8 bytes, host order."""


def gloo_sequence_numbers(world_size: int) -> range:
    """The sequence numbers a gloo group's pairs of `world_size` ranks may wait for (0..2*world_size+1)."""
    return range(2 * world_size + 2)


def check_gloo_handshake(version: Optional[str] = None) -> None:
    """Refuse a torch whose gloo was not verified to take release_gloo_connection_waits' connections:
    on another gloo the connections could be misread, and a rank stuck creating a group would
    stay stuck until its hard timeout with no word why. The in-process Wrapper calls it when a
    wrapped call starts; `make compat` runs the handshake's test (test_inprocess_group_creation)
    on the newest torch, and a release is added to TESTED_TORCH_VERSIONS once it passed there."""
    require_tested_release(_GLOO_HANDSHAKE, _GLOO_HANDSHAKE_PURPOSE, version)


def release_gloo_connection_waits(listeners: Iterable[Tuple[str, int]], world_size: int,
                                  timeout: float = 0.5) -> int:
    """End a gloo group constructor's wait for a peer's connection (nvrx_core.inprocess.abort).

    A pair of a gloo group being created waits on its listening socket for a connection that
    carries the pair's sequence number. This connects to each listener once per number in
    gloo_sequence_numbers(world_size), sends it (GLOO_SEQUENCE_FORMAT) and closes the
    connection at once: the waiting pair gets a connection that ends immediately and the
    constructor raises ("Connection closed by peer"). Numbers no pair waits for are parked by
    the listener and freed with the group. Returns the connections made.
    """
    check_gloo_handshake()
    made = 0
    for host, port in listeners:
        for seq in gloo_sequence_numbers(world_size):
            try:
                with socket.create_connection((host, port), timeout=timeout) as conn:
                    conn.sendall(struct.pack(GLOO_SEQUENCE_FORMAT, seq))
                made += 1
            except OSError as e:  # the listener is gone or full: nobody waits on it any more
                logger.debug("releasing %s:%d (sequence %d): %s", host, port, seq, e)
                break
    return made


# ---- tensors -------------------------------------------------------------------------------

def tensor_use_count(tensor: torch.Tensor) -> int:
    """How many references the C++ side holds to `tensor` (the caller's own counts as one):
    nvrx_core.collectives waits until a backend's worker thread has let go of a tensor."""
    return require(torch.Tensor, "_use_count", "a tensor's C++ reference count")(tensor)


# ---- Flight Recorder -----------------------------------------------------------------------

FLIGHT_RECORDER_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
"""How many collectives torch's Flight Recorder keeps per process (0, its default, turns it off)."""


def flight_recorder_json() -> bytes:
    """torch's Flight Recorder record of this process's collectives still in flight, as JSON:
    a hang report tells the rank that stopped from the ranks waiting for it by where each is
    in its groups' collective sequence. Works for gloo (CPU) and NCCL."""
    import torch._C._distributed_c10d as c10d

    dump = require(c10d, "_dump_fr_trace_json", "torch's Flight Recorder dump, read to tell a hung rank from its peers")
    return dump(True, True)  # includeCollectives, onlyActive
