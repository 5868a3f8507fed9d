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
"""

import dataclasses
import datetime
import logging
from typing import Mapping, Optional

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

    def connect(self) -> dist.TCPStore:
        """A new client connection (ranks other than 0 retry until the server is up)."""
        return dist.TCPStore(self.endpoint.host, self.endpoint.port, is_master=False,
                             timeout=self.timeout, wait_for_workers=False)

    def close(self) -> None:
        self.server = None
