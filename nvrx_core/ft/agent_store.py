"""AgentStoreRendezvous: a torch rendezvous handler whose workers always use the agent's store.

FaultTolerantAgent hosts a fresh, empty worker store per rendezvous round (agent.py: restarted
workers must never read the previous attempt's keys), so its workers must connect as clients
(TORCHELASTIC_USE_AGENT_STORE=True) whatever the wrapped handler's own store sharing is.
"""

from torch.distributed.elastic.rendezvous import RendezvousHandler


class AgentStoreRendezvous(RendezvousHandler):
    """Delegates to a torch rendezvous handler, but always lets workers use the agent's store."""

    def __init__(self, inner: RendezvousHandler):
        self.inner = inner

    def get_backend(self) -> str:
        return self.inner.get_backend()

    def next_rendezvous(self):
        return self.inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self):
        return self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()

    @property
    def use_agent_store(self) -> bool:
        return True

    def finish(self) -> None:
        """The job succeeded: a handler with waiting spares lets them exit 0."""
        if hasattr(self.inner, "finish"):
            self.inner.finish()

    def stop_heartbeat(self) -> None:
        """A handler with a heartbeat thread stops it before the launcher exits."""
        if hasattr(self.inner, "stop_heartbeat"):
            self.inner.stop_heartbeat()
