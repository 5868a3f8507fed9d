"""Tearing down an iteration's distributed state so blocked ranks return.

NCCL: ProcessGroup.abort() (public) cancels outstanding work; then the groups are destroyed.

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

A gloo group being created can wait for a peer's incoming connection (the pair whose address
compares lower waits, the other connects). torch 2.13's gloo bounds that wait only by 5x the
group timeout; when the peer gave up (its own connect failed: an ordinary exception there),
nothing else ends it, and no socket exists yet for the abort to shut down: the waiting
side sits in the ProcessGroupGloo constructor until the hard timeout kills it. The one
event that ends the wait is a connection on the group's listening socket carrying the
sequence number the pair waits for. So the monitor thread gives each listening socket
opened during the iteration (IterationConnections.listeners) those connections, each
closed at once (torch_compat.release_gloo_connection_waits: gloo's handshake, checked
against the torch versions it was verified with): the waiting pair gets a connection that
ends immediately, the constructor raises ("Connection closed by peer"), and the pending
interruption turns that into a restart. It runs only for an aborted iteration whose main
thread is stuck inside process-group creation.

Destroying an aborted group can block: ~ProcessGroupGloo joins its worker threads, and a
worker that was running a collective queued behind the failed one can sit in a receive
until the group's timeout (30 minutes by default), because gloo does not fail a receive
posted on a connection that was already closed. A group whose last reference drops in
the main thread can also deadlock, when DDP's reducer is freed (GIL held) right after a
collective whose worker still needs the GIL to free its tensors. So the groups are
referenced from their creation on, and release() hands the references to a daemon
thread that drops them: torch releases the GIL while destroying a process group, so a
destructor that waits for a stuck worker only holds up that thread, never training.
The interpreter's exit waits for that thread (nvrx_core.teardown.finish_before_exit),
bounded by REAPER_EXIT_WAIT_S: a worker stuck in a receive until the group's timeout is
not waited for.
"""

import gc
import logging
import os
import socket
import threading
from typing import Iterable, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from nvrx_core import teardown, torch_compat
from nvrx_core.collectives import is_nccl

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
        self._adopted: Set[SocketId] = set()

    def begin(self) -> None:
        self._baseline = open_sockets()

    def adopt(self, sockets: Iterable[SocketId]) -> None:
        """Sockets opened before the iteration that belong to it (shut down with it)."""
        self._adopted = set(sockets)

    def _ours(self) -> Set[SocketId]:
        if self._baseline is None:  # no iteration began: nothing is ours to shut down
            return set()
        now = open_sockets()
        return (now - self._baseline) | (self._adopted & now)

    def shut_down(self) -> int:
        count = 0
        for fd, link in self._ours():
            if self._shut_down_one(fd, link):
                count += 1
        return count

    def listeners(self) -> List[Tuple[str, int]]:
        """(host, port) of the TCP sockets listening since the iteration began."""
        found = []
        for fd, link in self._ours():
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if (os.readlink(f"/proc/self/fd/{fd}") == link and sock.type == socket.SOCK_STREAM
                        and sock.family in (socket.AF_INET, socket.AF_INET6)
                        and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                    host, port = sock.getsockname()[:2]
                    if host in ("0.0.0.0", "::"):
                        host = "127.0.0.1" if sock.family == socket.AF_INET else "::1"
                    found.append((host, port))
            except OSError:
                pass
            finally:
                sock.close()
        return found

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


def peer_port(fd: int) -> Optional[int]:
    """The remote port of a connected TCP socket, or None."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            return sock.getpeername()[1]
    except (OSError, IndexError, TypeError):
        return None


def process_groups() -> List[dist.ProcessGroup]:
    """Every live process group (the default one first)."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    groups = torch_compat.all_process_groups()
    default = dist.group.WORLD
    return sorted(groups, key=lambda g: g is not default)


def reset_group_names() -> None:
    """Let the next unnamed process group be named "0" again, on every rank alike.

    c10d names a group by a process-wide counter, taken when creation begins, and store
    keys carry the name. destroy_process_group() of the default group resets the counter,
    but a rank whose init_process_group failed has no default group: its counter stays
    ahead of the ranks that did create one. In the next iteration the ranks then wait for
    each other under different names, a hang that repeats in every later iteration.
    """
    torch_compat.reset_group_counter()


class AbortProcessGroups:
    """Aborts (any thread) and destroys (main thread) the iteration's process groups.

    Made when a wrapped call starts, so a torch whose gloo handshake this abort was not verified
    with is refused there, before training, not in the middle of an abort."""

    def __init__(self, connections: IterationConnections, empty_cuda_cache: bool = True):
        torch_compat.check_gloo_handshake()
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
                if is_nccl(group):
                    group.abort()
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
        if dist.is_available():
            reset_group_names()
        if self.empty_cuda_cache and torch.version.cuda is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def release(self) -> None:
        """Destroy the held groups in the background (see the module docstring)."""
        with self._lock:
            held, self._held = self._held, {}
        gc.collect()  # DDP objects of a failed iteration are often in reference cycles
        if held:
            reaper = threading.Thread(target=held.clear, name="nvrx-inprocess-pg-reaper", daemon=True)
            reaper.start()
            teardown.finish_before_exit(reaper.join, REAPER_EXIT_WAIT_S)


REAPER_EXIT_WAIT_S = 30.0
"""How long a finishing interpreter waits for a reaper still destroying aborted groups."""
