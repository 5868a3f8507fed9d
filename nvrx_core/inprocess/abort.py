"""Tearing down an iteration's distributed state so blocked ranks return.

NCCL: ProcessGroupNCCL.abort() cancels outstanding work; then the groups are destroyed.

Gloo has no working abort (abort(), shutdown() and destroy_process_group() on torch 2.13
all leave a collective that is waiting for a peer blocked). What does release it is its
TCP connections failing: a collective waiting on a closed connection raises "Connection
closed by peer" at once, locally and on the peer. So the abort shuts down (SHUT_RDWR) the
TCP connections the iteration opened: every socket created since the iteration began,
except listening sockets (gloo's listener must stay open or its accept loop dies) and
the server side of the coordination store when this rank hosts it. The Wrapper's own
store clients were opened before the iteration, so they are kept. A connection the
training function itself opened during the iteration (an HTTP client, say) is shut down
too; it belongs to the failed iteration.

Destroying an aborted group can block: ~ProcessGroupGloo joins its worker threads, and a
worker that was running a collective queued behind the failed one can sit in a receive
until the group's timeout (30 minutes by default), because gloo does not fail a receive
posted on a connection that was already closed. A group whose last reference drops in
the main thread can also deadlock, when DDP's reducer is freed (GIL held) right after a
collective whose worker still needs the GIL to free its tensors. So the groups are
referenced from their creation on, and release() hands the references to a daemon
thread that drops them: torch releases the GIL while destroying a process group, so a
destructor that waits for a stuck worker only holds up that thread, never training.
"""

import gc
import logging
import os
import socket
import threading
from typing import List, Optional, Set, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger("nvrx.inprocess")

SocketId = Tuple[int, str]  # (fd, "socket:[inode]")


def open_sockets() -> Set[SocketId]:
    """The process's sockets as (fd, inode link); empty where /proc is not available."""
    found = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add((int(fd), link))
    return found


class IterationConnections:
    """TCP connections opened since begin(); shut_down() fails them."""

    def __init__(self, protected_local_port: Optional[int] = None):
        self.protected_local_port = protected_local_port
        self._baseline: Optional[Set[SocketId]] = None

    def begin(self) -> None:
        self._baseline = open_sockets()

    def shut_down(self) -> int:
        if self._baseline is None:  # no iteration began: nothing is ours to shut down
            return 0
        count = 0
        for fd, link in open_sockets() - self._baseline:
            if self._shut_down_one(fd, link):
                count += 1
        return count

    def _shut_down_one(self, fd: int, link: str) -> bool:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return False
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:  # fd reused since the listing
                return False
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                return False
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False
            if self.protected_local_port is not None and sock.getsockname()[1] == self.protected_local_port:
                return False
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False  # already closed or not connected
        finally:
            sock.close()  # closes the dup only


def process_groups() -> List[dist.ProcessGroup]:
    """Every live process group (the default one first)."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    world = dist.distributed_c10d._world  # no public API lists subgroups
    groups = list(getattr(world, "pg_map", {}).keys())
    default = dist.group.WORLD
    return sorted(groups, key=lambda g: g is not default)


class AbortProcessGroups:
    """Aborts (any thread) and destroys (main thread) the iteration's process groups."""

    def __init__(self, connections: IterationConnections, empty_cuda_cache: bool = True):
        self.connections = connections
        self.empty_cuda_cache = empty_cuda_cache
        self._lock = threading.Lock()
        self._held: dict = {}

    def hold_current(self) -> None:
        """Keep every existing process group alive until release() (any thread)."""
        try:
            groups = process_groups()
        except Exception:  # a group being created or destroyed right now: next time
            return
        with self._lock:
            for group in groups:
                self._held.setdefault(id(group), group)

    def abort_communication(self) -> int:
        """Make blocked collectives return; safe from the monitor thread. Returns sockets shut down."""
        for group in process_groups():
            try:
                if "nccl" in dist.get_backend(group):
                    group._get_backend(torch.device("cuda")).abort()
            except Exception as e:  # a group being destroyed concurrently, or no NCCL backend
                logger.debug("abort of %s skipped: %s", group, e)
        return self.connections.shut_down()

    def destroy(self) -> None:
        """Destroy every process group; keep the objects until release()."""
        self.hold_current()
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:
                logger.warning("destroy_process_group failed after abort: %s", e)
        if self.empty_cuda_cache and torch.version.cuda is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def release(self) -> None:
        """Destroy the held groups in the background (see the module docstring)."""
        with self._lock:
            held, self._held = self._held, {}
        gc.collect()  # DDP objects of a failed iteration are often in reference cycles
        if held:
            threading.Thread(target=held.clear, name="nvrx-inprocess-pg-reaper", daemon=True).start()
