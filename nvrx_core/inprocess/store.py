"""Where the Wrapper's coordination store lives, and how to open more clients to it.

Preference order (the first that applies):
1. NVRX_INPROCESS_STORE=host:port: a store someone else hosts (a job service, a test).
2. Under torchrun / ft_launcher (TORCHELASTIC_USE_AGENT_STORE=True): the agent's store at
   MASTER_ADDR:MASTER_PORT. It lives in the launcher, so it survives any rank's death,
   and ft_launcher gives every restart attempt a fresh one. Keys are still namespaced by
   run id and restart count, because torchrun reuses one store across attempts.
3. Otherwise rank 0 hosts a store on MASTER_PORT + 1 (MASTER_PORT stays free for
   whatever else the job does). Such a store dies with rank 0: a lost rank 0 then ends
   the job instead of being replaced.

Every user of the store gets its own client (one TCP connection): a TCPStore client
serialises its requests, so a heartbeat must never queue behind a long blocking wait
of another thread.

A TCPStore client waits for an answer without limit: add, check and compare_set have no
timeout at all (torch 2.13), and connecting to a server that accepted the TCP connection
but does not run waits forever for its validation ping. The watchdogs (the monitor
thread, the hard-timeout monitor process) must keep working while the store stalls, so
they use BoundedStore. Each TCPStore connection also reverse-resolves the peer's address
(getnameinfo) on both ends; a DNS server that drops that query stalls the connecting rank,
or the whole store server, for the resolver's 5 s timeout. So the Wrapper opens its
connections where a delay costs nothing (before a barrier), never while ranks train.
"""

import dataclasses
import datetime
import logging
import queue
import threading
import time
from typing import Any, Callable, Mapping, Optional

import torch.distributed as dist

STORE_ENV = "NVRX_INPROCESS_STORE"
logger = logging.getLogger("nvrx.inprocess")


class StoreSetupError(RuntimeError):
    """The environment does not say where the coordination store is."""


@dataclasses.dataclass(frozen=True)
class StoreEndpoint:
    host: str
    port: int
    hosted_by_rank0: bool
    key_prefix: str
    """Namespace of this launch attempt (run id, restart count) inside a shared store."""

    def describe(self) -> str:
        owner = "hosted by rank 0" if self.hosted_by_rank0 else "external"
        return f"{self.host}:{self.port} ({owner}, prefix {self.key_prefix!r})"


def endpoint_from_env(env: Mapping[str, str]) -> StoreEndpoint:
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"nvrx_inprocess/{run_id}/{attempt}"
    if env.get(STORE_ENV):
        host, _, port = env[STORE_ENV].rpartition(":")
        if not host or not port.isdigit():
            raise StoreSetupError(f"{STORE_ENV}={env[STORE_ENV]!r}: expected host:port")
        return StoreEndpoint(host, int(port), False, prefix)
    try:
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        raise StoreSetupError(
            f"no coordination store: set MASTER_ADDR and MASTER_PORT (torchrun / ft_launcher do), "
            f"or {STORE_ENV}=host:port"
        ) from None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return StoreEndpoint(host, port, False, prefix)
    return StoreEndpoint(host, port + 1, True, prefix)


class StoreClients:
    """Opens clients to one endpoint; rank 0 also hosts the server when the endpoint says so."""

    def __init__(self, endpoint: StoreEndpoint, rank: int, world_size: int, timeout: float):
        self.endpoint = endpoint
        self.timeout = datetime.timedelta(seconds=timeout)
        self.server: Optional[dist.TCPStore] = None
        if endpoint.hosted_by_rank0 and rank == 0:
            self.server = dist.TCPStore(endpoint.host, endpoint.port, world_size, is_master=True,
                                        timeout=self.timeout, wait_for_workers=False)
            logger.debug("rank 0 hosts the in-process store on %s", endpoint.describe())

    def connect(self, timeout: Optional[float] = None) -> dist.TCPStore:
        """A new client connection (ranks other than 0 retry until the server is up).

        `timeout` bounds its waits (wait, get); other requests have no bound (see BoundedStore).
        """
        limit = self.timeout if timeout is None else datetime.timedelta(seconds=timeout)
        return dist.TCPStore(self.endpoint.host, self.endpoint.port, is_master=False, timeout=limit,
                             wait_for_workers=False)

    def bounded(self, timeout: float, name: str) -> "BoundedStore":
        """A client whose every request ends within `timeout` seconds (for the watchdogs)."""
        def connect() -> dist.TCPStore:
            client = self.connect()  # connecting may take long (the caller does not wait for it)
            client.set_timeout(datetime.timedelta(seconds=timeout))
            return client

        return BoundedStore(connect, timeout, name)

    def close(self) -> None:
        self.server = None


class StoreUnavailable(RuntimeError):
    """The store did not answer a request within the bounded client's timeout."""


class _Request:
    def __init__(self, method: str, args: tuple, started: float):
        self.method, self.args, self.started = method, args, started
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.finished: Optional[float] = None
        self.abandoned = False


class BoundedStore:
    """A store client whose every request returns or fails within `timeout` seconds.

    Requests run one at a time in a worker thread; the caller waits at most `timeout`. A
    request that ran over keeps its place: the worker goes on waiting for its answer, so
    the connection stays in step with the server (a timed-out TCPStore client would read
    the late answer as the answer to its next request), and requests made meanwhile fail
    at once with StoreUnavailable. A stall thus costs neither threads nor connections,
    and a mutation that timed out may still be applied when the store comes back. After
    an error the connection is dropped and the next request opens a new one.
    Latency: a request slower than `slow` seconds is logged, and so are the start and the
    end of a stall.
    """

    def __init__(self, connect: Callable[[], Any], timeout: float, name: str, slow: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self._connect, self.timeout, self.name = connect, timeout, name
        self.slow = timeout / 2 if slow is None else slow
        self._clock = clock
        self._lock = threading.Lock()
        self._queue: "queue.SimpleQueue[Optional[_Request]]" = queue.SimpleQueue()
        self._client: Any = None
        self._pending: Optional[_Request] = None
        self._worker: Optional[threading.Thread] = None
        self.max_latency = 0.0
        self.stalls = 0

    def connect_now(self) -> None:
        """Open the connection in the caller's thread (where a slow connect costs nothing)."""
        with self._lock:
            if self._client is None and self._pending is None:
                self._client = self._connect()

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args: self.call(method, *args)

    def call(self, method: str, *args: Any) -> Any:
        with self._lock:
            pending = self._pending
            if pending is not None and not pending.done.is_set():
                raise StoreUnavailable(f"{self.name}: the store has not answered {pending.method} for "
                                       f"{self._clock() - pending.started:.1f} s")
            request = self._pending = _Request(method, args, self._clock())
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name=f"{self.name}-store", daemon=True)
                self._worker.start()
        self._queue.put(request)
        if not request.done.wait(self.timeout):
            with self._lock:
                request.abandoned = not request.done.is_set()
            if request.abandoned:
                self.stalls += 1
                logger.warning("%s: the store did not answer %s within %.1f s; requests fail until it does",
                               self.name, method, self.timeout)
                raise StoreUnavailable(f"{self.name}: {method} got no answer within {self.timeout} s")
        latency = request.finished - request.started
        self.max_latency = max(self.max_latency, latency)
        if latency > self.slow:
            logger.warning("%s: the store took %.2f s to answer %s", self.name, latency, method)
        if request.error is not None:
            raise request.error
        return request.result

    def _serve(self) -> None:
        while True:
            request = self._queue.get()
            if request is None:
                return
            try:
                if self._client is None:
                    self._client = self._connect()
                request.result = getattr(self._client, request.method)(*request.args)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                request.error = e
                self._client = None  # the connection may be out of step with the server
            with self._lock:
                request.finished = self._clock()
                request.done.set()
                late = request.abandoned
            if late:
                self.max_latency = max(self.max_latency, request.finished - request.started)
                logger.warning("%s: the store answered %s after %.1f s", self.name, request.method,
                               request.finished - request.started)

    def close(self) -> None:
        """Stop the worker (at once if idle; a worker still waiting on the store is a daemon)."""
        self._queue.put(None)
        self._client = None
