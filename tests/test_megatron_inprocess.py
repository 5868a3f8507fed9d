"""nvrx_megatron.inprocess_restart: Bridge's entry points on the core Wrapper.

Unit tests check what reaches the Wrapper (every InProcessRestartConfig field) and the
errors; the job tests run tests/scripts/megatron_inprocess_job.py on 2 gloo ranks, with the
coordination store hosted by the test process (as ft_launcher's agent hosts it), and read
each rank's own timeline.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from nvrx_core.config import ConfigError
from nvrx_core.events import read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.inprocess import InProcessGaveUp, KeepWholeNodes, RestartState
from nvrx_megatron import InProcessRestartConfig
from nvrx_megatron import inprocess_restart as adapter
from harness.stores import host_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "tests", "scripts", "megatron_inprocess_job.py")
WORLD = 2
# Short timeouts so a broken recovery fails the test quickly; last_call_wait is Bridge's field, small here.
FAST = dict(soft_timeout=5.0, hard_timeout=10.0, heartbeat_interval=0.5, heartbeat_timeout=8.0, barrier_timeout=30.0,
            completion_timeout=30.0, monitor_thread_interval=0.1, monitor_process_interval=0.2,
            progress_watchdog_interval=0.1, last_call_wait=0.05, termination_grace_time=1.0)


# ---- what reaches the Wrapper ---------------------------------------------------------------
class SpyWrapper(adapter.Wrapper):
    built = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        SpyWrapper.built.append(self)


@pytest.fixture
def spy(monkeypatch):
    SpyWrapper.built = []
    monkeypatch.setattr(adapter, "Wrapper", SpyWrapper)
    return SpyWrapper.built


# Bridge field, value set, core field it must reach, value the core must hold.
FIELDS = [
    ("enabled", True, "enabled", True),
    ("max_iterations", 4, "max_iterations", 4),
    ("monitor_thread_interval", 0.3, "monitor_interval", 0.3),
    ("monitor_process_interval", 0.7, "monitor_process_interval", 0.7),
    ("progress_watchdog_interval", 0.4, "progress_watchdog_interval", 0.4),
    ("heartbeat_interval", 2.0, "heartbeat_interval", 2.0),
    ("soft_timeout", 20.0, "soft_timeout", 20.0),
    ("hard_timeout", 100.0, "hard_timeout", 100.0),
    ("heartbeat_timeout", 50.0, "heartbeat_timeout", 50.0),
    ("barrier_timeout", 100.0, "barrier_timeout", 100.0),
    ("completion_timeout", 70.0, "completion_timeout", 70.0),
    ("last_call_wait", 0.25, "last_call_wait", 0.25),
    ("termination_grace_time", 3.0, "termination_grace", 3.0),
    ("granularity", "rank", "granularity", "rank"),
    ("active_world_size", 3, "active_world_size", 3),
    ("active_world_size", 3, "min_active_world_size", 3),  # Bridge: exactly this many train, else give up
    ("empty_cuda_cache", False, "empty_cuda_cache", False),
    ("max_rank_faults", 2, "max_rank_faults", 2),
    ("monitor_process_logdir", "/tmp/nvrx-monitor-logs", "monitor_log_dir", "/tmp/nvrx-monitor-logs"),
    ("respawn_timeout", 45.0, "respawn_timeout", 45.0),                   # ours, after Bridge's fields
]


@pytest.mark.parametrize("bridge, value, core, expected", FIELDS, ids=[f"{b}->{c}" for b, _, c, _ in FIELDS])
def test_each_field_reaches_the_wrapper(spy, bridge, value, core, expected):
    config = InProcessRestartConfig(**{"enabled": True, bridge: value})
    wrapped, store = adapter.maybe_wrap_for_inprocess_restart(lambda: None, config, None)
    assert len(spy) == 1 and isinstance(store, adapter.RestartStore)
    assert getattr(spy[0].config, core) == expected
    assert spy[0].health_check is not None  # GPU, NVLink and CUDA checks after a fault


def test_every_bridge_field_is_in_the_table():
    import dataclasses

    assert {f.name for f in dataclasses.fields(InProcessRestartConfig)} == {b for b, _, _, _ in FIELDS}


def test_bridge_defaults_reach_the_core(spy):
    adapter.maybe_wrap_for_inprocess_restart(lambda: None, InProcessRestartConfig(enabled=True), None)
    core = spy[0].config
    assert (core.heartbeat_interval, core.heartbeat_timeout, core.termination_grace, core.granularity) == \
        (30.0, 60.0, 1.0, "node")
    assert (core.monitor_process_interval, core.progress_watchdog_interval, core.last_call_wait) == (1.0, 1.0, 1.0)
    assert (core.max_iterations, core.active_world_size, core.min_active_world_size) == (None, None, 1)


def test_node_granularity_keeps_whole_nodes(spy):
    adapter.inprocess_restart(lambda: None, InProcessRestartConfig(granularity="node"), None)
    assert any(isinstance(p, KeepWholeNodes) for p in spy[0].rank_assignment.policies)


def test_inprocess_restart_wraps_even_when_disabled_as_bridge_does(spy):
    def train_fn(inprocess_call_wrapper=None):
        return inprocess_call_wrapper

    wrapped = adapter.inprocess_restart(train_fn, InProcessRestartConfig(enabled=False), None)
    assert wrapped is not train_fn and spy[0].config.enabled
    assert wrapped.__name__ == "train_fn" and wrapped.__qualname__ == train_fn.__qualname__


def test_disabled_returns_the_function_unchanged_and_no_store(spy):
    def train_fn():
        pass

    assert adapter.maybe_wrap_for_inprocess_restart(train_fn, InProcessRestartConfig(), None) == (train_fn, None)
    assert spy == []


@pytest.mark.parametrize("fields, message", [
    ({"progress_watchdog_interval": 60.0}, r"progress_watchdog_interval=60.0: must be < soft_timeout"),
    ({"monitor_process_interval": 70.0, "soft_timeout": 80.0, "hard_timeout": 100.0},
     r"monitor_process_interval=70.0: must be < heartbeat_timeout"),
    ({"last_call_wait": 120.0}, r"last_call_wait=120.0: must be < barrier_timeout"),
    ({"active_world_size": 0}, r"active_world_size=0"),
])
def test_bad_input_names_the_field(spy, fields, message):
    """Rules that need the three fields the config only checks alone surface when wrapping."""
    with pytest.raises(ConfigError, match=r"InProcessRestartConfig: " + message):
        adapter.maybe_wrap_for_inprocess_restart(lambda: None, InProcessRestartConfig(enabled=True, **fields), None)
    assert spy == []


@pytest.mark.parametrize("fields, message", [
    ({"max_iterations": 0}, r"max_iterations=0"),
    ({"monitor_process_interval": 0}, r"monitor_process_interval=0"),
    ({"progress_watchdog_interval": -1.0}, r"progress_watchdog_interval=-1.0"),
    ({"last_call_wait": -1.0}, r"last_call_wait=-1.0"),
    ({"granularity": "gpu"}, r"granularity='gpu'"),
])
def test_bad_values_are_refused_when_the_config_is_built(fields, message):
    with pytest.raises(ConfigError, match=message):
        InProcessRestartConfig(enabled=True, **fields)


def test_restart_store_refuses_use_outside_an_iteration_and_forwards_inside():
    store = adapter.RestartStore()
    with pytest.raises(RuntimeError, match="only inside the wrapped training function"):
        store.set("k", "v")
    store.current = dist.HashStore()
    prefixed = dist.PrefixStore("0", store)  # what Bridge's _pretrain builds on it
    prefixed.set("k", "v")
    assert store.current.get("0/k") == b"v" and prefixed.add("n", 2) == 2 and store.check(["0/k"])


def test_the_call_gets_the_iterations_store_and_state(monkeypatch):
    """The adapter hands train_fn the iteration's store in place of the one it returned, and the RestartState."""
    seen = {}
    monkeypatch.setattr(adapter, "Wrapper", lambda config, health_check: (lambda fn: fn))

    def train_fn(x, store=None, inprocess_call_wrapper=None):
        seen.update(x=x, store=store, wrapper=inprocess_call_wrapper)

    wrapped, store = adapter.maybe_wrap_for_inprocess_restart(train_fn, InProcessRestartConfig(enabled=True), None)
    iteration_store = dist.HashStore()
    state = RestartState(iteration=0, rank=0, world_size=1, initial_rank=0, initial_world_size=1, local_rank=0,
                         store=iteration_store)
    wrapped(7, store=store, inprocess_call_wrapper="dropped", _nvrx_restart_state=state)
    assert seen == {"x": 7, "store": iteration_store, "wrapper": state} and store.current is None


def test_a_restarted_call_resets_the_global_state_first(monkeypatch):
    monkeypatch.setattr(adapter, "Wrapper", lambda config, health_check: (lambda fn: fn))
    order = []

    class Queue:
        def close(self, abort=False):
            order.append(("queue closed", abort))

    class GlobalState:
        async_calls_queue = Queue()

        def reset_for_restart(self):
            order.append("reset")

    wrapped = adapter.inprocess_restart(lambda inprocess_call_wrapper: order.append("train"),
                                        InProcessRestartConfig(), GlobalState())
    for iteration in (0, 1):
        state = RestartState(iteration=iteration, rank=0, world_size=1, initial_rank=0, initial_world_size=1,
                             local_rank=0, store=None)
        wrapped(_nvrx_restart_state=state)
    assert order == ["train", ("queue closed", True), "reset", "train"]


# ---- real 2-rank jobs ------------------------------------------------------------------------
def run_job(tmp_path, config, fault_iterations, timeout=150.0):
    """Start WORLD ranks of the job, wait for all (generous deadline), kill whatever is left."""
    store = host_store()  # a free port, held by us
    params = {"outdir": str(tmp_path), "config": {"enabled": True, **FAST, **config}, "steps": 30,
              "fault_rank": 1, "fault_step": 10, "fault_iterations": fault_iterations}
    procs = []
    try:
        for rank in range(WORLD):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                       TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1",
                       NVRX_EVENTS_FILE=str(tmp_path / "events.jsonl"))
            env.pop("GROUP_RANK", None)
            log = open(tmp_path / f"rank{rank}.log", "w")
            procs.append(subprocess.Popen([sys.executable, JOB, json.dumps(params)], env=env, cwd=REPO,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:  # each rank leads its own session: its monitor process goes with it
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    logs = "\n".join(f"--- rank {r}\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}" for r in range(WORLD))
    results = []
    for r in range(WORLD):
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return [p.pid for p in procs], [p.returncode for p in procs], results, logs


@pytest.mark.timeout(200)
def test_an_exception_in_one_rank_recovers_in_process_within_a_second(tmp_path):
    pids, codes, results, logs = run_job(tmp_path, {}, fault_iterations=[0])
    assert codes == [0, 0], logs
    for pid, result in zip(pids, results):
        assert [c["iteration"] for c in result["calls"]] == [0, 1], logs
        assert {c["pid"] for c in result["calls"]} == {pid}, "a process was restarted; the restart should be in-process"
        assert result["resets"] == 1 and result["ended"] == "returned"
    assert results[0]["value"] == results[1]["value"]  # both finished the same 30 steps
    fault = next(t for kind, t, _, _ in results[1]["timeline"] if kind == "fault")
    resumed = [next(t for kind, t, it, _ in r["timeline"] if kind == "step" and it == 1) for r in results]
    recovery = max(resumed) - fault
    print(f"fault -> next completed step on every rank: {recovery:.3f} s")
    assert 0 < recovery <= 1.0, logs
    events = read_events(str(tmp_path / "events.jsonl"))
    assert {(e["rank"], e["cause"]) for e in events if e["kind"] == "inprocess_interrupted"} >= {(1, "exception")}


@pytest.mark.timeout(200)
def test_max_iterations_bounds_restarts_then_every_rank_gives_up(tmp_path):
    pids, codes, results, logs = run_job(tmp_path, {"max_iterations": 2}, fault_iterations="all")
    assert codes == [ExitCode.INPROCESS_GAVE_UP] * WORLD, logs
    assert issubclass(InProcessGaveUp, SystemExit)
    for result in results:
        assert [c["iteration"] for c in result["calls"]] == [0, 1], logs  # called max_iterations times, no more
        assert result["ended"] == f"exit {int(ExitCode.INPROCESS_GAVE_UP)}"
    gave_up = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == "inprocess_gave_up"]
    assert len(gave_up) == WORLD and all("max_iterations=2" in e["reason"] for e in gave_up)
