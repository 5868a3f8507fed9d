"""The tests' shared harness: one owner for each thing tests keep needing.

- `wait_for`: poll a condition with a generous deadline (harness/waiting.py).
- `clock.FakeClock`: time a test advances, for decisions about timeouts.
- `timeline.all_arrive`: a collective on ranks' FakeClocks (recorded timings for straggler rankings).
- `node_monitor.NodeMonitorOnThread`, `Rank`: a real FT node monitor on a thread, real rank processes.
- `ranks.spawn_ranks` / `run_spawned_ranks` / `TorchrunLikeRanks` / `start_rank` / `kill_ranks`: rank processes.
- `stores.host_store` / `store_process` / `stop`: the TCPStore a test holds.
- `launcher.run_launcher` / `warm_popen` / `kill_tree`: ft_launcher as a real process.
- `checkpoint_gate.PublishGate`: a PathCheckpointer save held just before it publishes.
- `committed_steps.check_committed_steps`: the steps ranks committed after in-process roll-forwards (no process redoes one, none lost).

Tests import it by plain name (`from harness import wait_for`): conftest puts tests/ on sys.path,
and spawned rank scripts started from tests/ inherit that through PYTHONPATH where they need it.
"""

from harness.waiting import wait_for

__all__ = ["wait_for"]
