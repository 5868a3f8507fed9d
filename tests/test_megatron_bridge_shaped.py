"""nvrx_megatron's hooks with configs that are not nvrx_megatron's: Bridge-shaped objects.

A Bridge user's cfg.ft / nvrx_straggler / inprocess_restart / rerun_state_machine are Bridge's
own dataclasses. Here they are stood in for by plain dataclasses defined below with Bridge's
field names and defaults (and by SimpleNamespaces holding only some fields), and every hook is
run with them, off and on: the simulated fault fires, a real function restarts in-process on
gloo ranks, the straggler manager and the rerun machine run, Bridge's errors carry Bridge's
words. The fault-tolerance hooks also meet a train state without a step number.
"""

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from harness.node_monitor import NodeMonitorOnThread
from harness.ranks import run_spawned_ranks
from test_megatron_config import BRIDGE
from harness import wait_for

import warm_python
from nvrx_core.config import ConfigError
from nvrx_core.events import EventLog, read_events
from nvrx_core.ft.config import FTConfig
from nvrx_core.rerun import DeviceIdentity
from nvrx_megatron import (FaultToleranceConfig, InProcessRestartConfig, NVRxStragglerDetectionConfig,
                           RerunStateMachineConfig, convert)
from nvrx_megatron import fault_tolerance as ft
from nvrx_megatron.inprocess_restart import maybe_wrap_for_inprocess_restart
from nvrx_megatron.nvrx_straggler import NVRxStragglerDetectionManager, check_nvrx_straggler_detection
from nvrx_megatron.rerun_state_machine import RerunDataIterator, RerunStateMachine


# ---- stand-ins for Bridge's classes: Bridge's names and defaults (test_megatron_config's table,
# read from Bridge's source), nothing of ours ---------------------------------------------------
def _bridge_standin(name, ours):
    kw_only, table = BRIDGE[ours]
    return dataclasses.make_dataclass(name, [(field, object, default) for field, default, _ in table], kw_only=kw_only)


BridgeFT = _bridge_standin("BridgeFT", FaultToleranceConfig)
BridgeStraggler = _bridge_standin("BridgeStraggler", NVRxStragglerDetectionConfig)
BridgeInProcess = _bridge_standin("BridgeInProcess", InProcessRestartConfig)
BridgeRerun = _bridge_standin("BridgeRerun", RerunStateMachineConfig)  # keyword-only since Bridge 003e863


KINDS = ["dataclass", "namespace"]


def shaped(kind, cls, **fields):
    """A Bridge-shaped config: the stand-in dataclass, or a namespace with only `fields`."""
    return cls(**fields) if kind == "dataclass" else SimpleNamespace(**fields)


# ---- RerunStateMachineConfig is Bridge's current shape ---------------------------------------
def test_rerun_config_is_keyword_only_and_names_bridges_current_mode():
    """Its fields, defaults and kw_only: test_megatron_config.test_fields_match_bridge."""
    with pytest.raises(TypeError, match=r"keyword arguments only.*\(error_injection_rate=5\)"):
        RerunStateMachineConfig(5)
    with pytest.raises(ConfigError, match="now calls this mode 'report_determinism_stats'"):
        RerunStateMachineConfig(rerun_mode="report_stats")


# ---- conversions: a Bridge-shaped object gives what ours gives ---------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_bridge_shaped_config_converts_as_ours_and_is_left_unchanged(kind):
    cases = [
        (convert.straggler_config, BridgeStraggler, NVRxStragglerDetectionConfig,
         dict(enabled=True, report_time_interval=5.0, gpu_individual_perf_threshold=0.5)),
        (convert.inprocess_config, BridgeInProcess, InProcessRestartConfig,
         dict(enabled=True, soft_timeout=5.0, hard_timeout=9.0, granularity="rank")),
        (convert.rerun_config, BridgeRerun, RerunStateMachineConfig,
         dict(rerun_mode="validate_results", check_for_spiky_loss=True, spiky_loss_factor=4.0)),
        (convert.simulated_fault, BridgeFT, FaultToleranceConfig,
         dict(simulate_fault=True, simulated_fault_type="rank_hung", simulated_fault_base_delay=10)),
    ]
    for to_core, bridge_cls, ours_cls, fields in cases:
        config = shaped(kind, bridge_cls, **fields)
        before = vars(config).copy()
        assert to_core(config) == to_core(ours_cls(**fields)), bridge_cls.__name__
        assert vars(config) == before  # read, never written nor replaced


# ---- fault tolerance hooks, and a train state without a step number --------------------------
MISSING = "no train_state"


@pytest.fixture
def monitor(tmp_path, monkeypatch):
    signalled = []
    m = NodeMonitorOnThread(tmp_path, config=FTConfig(stack_dump_grace=0.05, initial_rank_heartbeat_timeout=60,
                                                rank_heartbeat_timeout=30),
                      send_signal=lambda watch, sig: signalled.append(sig) or True)
    m.signalled = signalled
    monkeypatch.setenv("NVRX_FT_MONITOR_SOCKET", m.path)
    monkeypatch.setenv("NVRX_EVENTS_FILE", str(tmp_path / "rank_events.jsonl"))
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(tmp_path / "finished"))
    monkeypatch.setenv("RANK", "0")
    yield m
    m.close()


def _ft_run(tmp_path, monitor, ft_config, steps, iterations=20):
    """A Bridge-style loop; `steps(i)` is train_state.step after iteration i (MISSING: no
    train_state at all). Returns the state and the progress events the rank wrote."""
    cfg = SimpleNamespace(ft=ft_config, checkpoint=SimpleNamespace(save=str(tmp_path / "ckpt"), async_save=False),
                          train=SimpleNamespace(train_iters=iterations))
    state = SimpleNamespace(cfg=cfg, rank_monitor_client=None)
    if steps is not MISSING:
        state.train_state = SimpleNamespace(step=steps(0))
    ft.setup(cfg, state)
    assert monitor.watch(os.getpid()) is not None  # connected: the hooks below are live, not no-ops
    for i in range(1, iterations + 1):
        ft.on_training_step_start(state)
        if steps is not MISSING:
            state.train_state.step = steps(i)
        ft.on_training_step_end(state)
    ft.on_checkpointing_start(state)
    ft.on_checkpointing_end(False, state)
    ft.shutdown(state)
    wait_for(lambda: monitor.watch(os.getpid()) is None, what="goodbye")
    path = tmp_path / "rank_events.jsonl"
    events = read_events(str(path)) if path.exists() else []
    return state, [(e["kind"], e.get("step")) for e in events if e["kind"] in ("training_resumed", "step_done")]


@pytest.mark.parametrize("kind", KINDS)
def test_ft_hooks_run_with_a_bridge_shaped_config(tmp_path, monitor, kind):
    config = shaped(kind, BridgeFT, enable_ft_package=True, calc_ft_timeouts=True)
    state, reported = _ft_run(tmp_path, monitor, config, steps=lambda i: torch.tensor(i))  # a 0-d tensor counts
    assert reported[0] == ("training_resumed", 0) and reported[-1] == ("step_done", 20)
    assert (tmp_path / "finished").exists() and state.rank_monitor_client is None
    assert (tmp_path / "ckpt" / "ft_state.json").exists()  # calc_ft_timeouts was read from the object
    assert monitor.signalled == []


@pytest.mark.parametrize("step", [None, "n/a", MISSING])
def test_a_train_state_without_a_step_number_keeps_the_hooks_running(tmp_path, monitor, caplog, step):
    with caplog.at_level("WARNING", logger="nvrx.megatron.ft"):
        state, reported = _ft_run(tmp_path, monitor, BridgeFT(enable_ft_package=True),
                                  steps=step if step is MISSING else (lambda i: step))
    assert reported == []  # no number: no progress, no resumed-at event; the loop ran on
    assert not (tmp_path / "finished").exists() and "not a step number" in caplog.text
    assert state.rank_monitor_client is None and monitor.signalled == []


# ---- simulated fault ---------------------------------------------------------------------------
FAULT_SCRIPT = """
import json, sys, time
from nvrx_megatron import fault_tolerance as ft
from test_megatron_bridge_shaped import BridgeFT, shaped

# fires at once (delay 0) in this rank: killed or stopped before the sleep ends
ft.maybe_setup_simulated_fault(shaped(sys.argv[1], BridgeFT, **json.loads(sys.argv[2])))
time.sleep(30)
sys.exit(3)
"""


def _process_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


@pytest.mark.parametrize("kind, fault", [("dataclass", "rank_killed"), ("namespace", "rank_hung")])
def test_a_simulated_fault_from_a_bridge_shaped_config_fires(tmp_path, kind, fault):
    script = tmp_path / "fault.py"
    script.write_text(FAULT_SCRIPT)
    events = tmp_path / "events.jsonl"
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", NVRX_EVENTS_FILE=str(events),
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    fields = dict(simulate_fault=True, simulated_fault_type=fault, simulated_fault_rank=1, simulated_fault_base_delay=0)
    proc = warm_python.popen([str(script), kind, json.dumps(fields)], env=env)
    try:
        if fault == "rank_killed":
            assert proc.wait(60) == -9
        else:
            wait_for(lambda: _process_state(proc.pid) == "T", timeout=60, what="the rank stopped (SIGSTOP)")
    finally:
        proc.kill()
        proc.wait(60)
    assert [e["fault"] for e in read_events(str(events)) if e["kind"] == "fault_injected"] == [fault]


@pytest.mark.parametrize("kind", KINDS)
def test_a_simulated_fault_switched_off_arms_nothing(kind):
    assert ft.maybe_setup_simulated_fault(shaped(kind, BridgeFT, simulate_fault=False)) is None
    assert ft.maybe_setup_simulated_fault(SimpleNamespace(simulate_fault=False, simulated_fault_type="bogus")) is None
    assert ft.maybe_setup_simulated_fault(None) is None


# ---- in-process restart: a real function on gloo ranks -----------------------------------------
FAST = dict(soft_timeout=5.0, hard_timeout=10.0, heartbeat_interval=0.5, heartbeat_timeout=8.0, barrier_timeout=30.0,
            completion_timeout=30.0, monitor_thread_interval=0.1, monitor_process_interval=0.2,
            progress_watchdog_interval=0.1, last_call_wait=0.05)
STEPS = 5


def _inprocess_rank(rank, world, port, out_dir):
    """One rank of a Bridge-style pretrain(): maybe_wrap_for_inprocess_restart, then the call."""
    import datetime

    params = json.load(open(os.path.join(out_dir, "params.json")))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      OMP_NUM_THREADS="1", NVRX_EVENTS_FILE=os.path.join(out_dir, "events.jsonl"))
    torch.set_num_threads(1)
    record = {"calls": [], "resets": 0}
    state = SimpleNamespace(async_calls_queue=None,
                            reset_for_restart=lambda: record.update(resets=record["resets"] + 1))

    def pretrain(state, store=None, inprocess_call_wrapper=None):
        iteration = 0 if inprocess_call_wrapper is None else inprocess_call_wrapper.iteration
        record["calls"].append([iteration, os.getpid()])
        if inprocess_call_wrapper is not None:  # Bridge's _pretrain: the group on the iteration's store
            store = dist.PrefixStore(str(iteration), store)
        else:
            store = dist.PrefixStore("off", dist.TCPStore("127.0.0.1", port, is_master=False))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=20))
        total = torch.zeros(1)
        for step in range(STEPS):
            if params["fault"] and iteration == 0 and rank == world - 1 and step == 2:
                raise ValueError("injected fault")
            contribution = torch.ones(1) * (rank + 1)
            dist.all_reduce(contribution)
            total += contribution
        dist.barrier()
        dist.destroy_process_group()
        return total.item()

    config = shaped(params["kind"], BridgeInProcess, **params["config"])
    wrapped, store = maybe_wrap_for_inprocess_restart(pretrain, config, state)
    record["wrapped"] = wrapped is not pretrain and store is not None
    record["value"] = wrapped(state, store=store)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def _run_ranks(tmp_path, kind, world, config, fault):
    (tmp_path / "params.json").write_text(json.dumps({"kind": kind, "config": config, "fault": fault}))
    run_spawned_ranks(_inprocess_rank, world, str(tmp_path), timeout=120.0)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind, world", [("dataclass", 2), ("namespace", 1)])
def test_a_bridge_shaped_config_restarts_a_real_function_in_process(tmp_path, kind, world):
    results = _run_ranks(tmp_path, kind, world, {"enabled": True, **FAST}, fault=True)
    for result in results:
        assert result["wrapped"] and result["resets"] == 1
        assert [it for it, _ in result["calls"]] == [0, 1]
        assert len({pid for _, pid in result["calls"]}) == 1  # the same process: restarted in-process
        assert result["value"] == STEPS * world * (world + 1) / 2
    interrupted = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == "inprocess_interrupted"]
    assert {(e["rank"], e["cause"]) for e in interrupted} >= {(world - 1, "exception")}


@pytest.mark.timeout(180)
def test_a_bridge_shaped_config_switched_off_runs_the_function_unwrapped(tmp_path):
    results = _run_ranks(tmp_path, "namespace", 2, {"enabled": False, "soft_timeout": "not read when off"},
                         fault=False)
    for result in results:
        assert not result["wrapped"] and [it for it, _ in result["calls"]] == [0] and result["value"] == STEPS * 3


# ---- straggler manager and rerun machine -------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_the_straggler_manager_runs_off_and_on_with_a_bridge_shaped_config(kind):
    off = NVRxStragglerDetectionManager(shaped(kind, BridgeStraggler, enabled=False))
    off.initialize()
    assert not off.initialized and off.wrap_train_step_function(len) is len
    assert check_nvrx_straggler_detection(off) is False
    clock = SimpleNamespace(now=1000.0)
    config = shaped(kind, BridgeStraggler, enabled=True, report_time_interval=1.0, num_gpu_perf_scores_to_print=0,
                    stop_if_detected=True)
    manager = NVRxStragglerDetectionManager(config, clock=lambda: clock.now, timer=lambda: clock.now,
                                            warmup_reports=0, consecutive_reports=1)
    manager.initialize()
    assert manager.logger.name == "megatron.bridge.NVRxStragglerDetection"  # Bridge's default, when absent
    answers = []
    for step_s in [0.010] * 300 + [0.020] * 300:  # then twice as slow: individual score 0.5 < 0.7
        manager.wrap_train_step_function(lambda: setattr(clock, "now", clock.now + step_s))()
        answers.append(check_nvrx_straggler_detection(manager))
    assert not any(answers[:300]) and any(answers[300:]) and manager.last_report.flagged_ranks == (0,)
    manager.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_the_rerun_machine_runs_off_and_on_with_a_bridge_shaped_config(kind):
    def one_step(machine, data):
        while machine.should_run_forward_backward(data):
            machine.validate_result(torch.tensor(next(data)), torch.isnan, "loss is NaN", fatal=True)
        return machine.should_checkpoint_and_exit()

    off = RerunStateMachine(shaped(kind, BridgeRerun, rerun_mode="disabled"), events=EventLog(None))
    assert off.mode.value == "disabled" and one_step(off, iter([1.0])) == (False, False, 0)
    machine = RerunStateMachine(shaped(kind, BridgeRerun, rerun_mode="validate_results"), events=EventLog(None),
                                device_identity=DeviceIdentity("node-a", "cuda:0", "GPU-a"))
    data = RerunDataIterator([1.0, float("nan")])
    assert one_step(machine, data) == (False, False, 0)
    assert one_step(machine, data) == (True, True, 16)  # a NaN reproduced in place: resume elsewhere


# ---- errors: Bridge's words where Bridge has a rule, ours named as clearly elsewhere ------------
_straggler, _simulated, _rerun = NVRxStragglerDetectionManager, ft.maybe_setup_simulated_fault, RerunStateMachine


def _inprocess(config):
    return maybe_wrap_for_inprocess_restart(lambda: None, config, None)


# (hook, Bridge-shaped class, fields, words of the ConfigError)
ERRORS = [
    (_straggler, BridgeStraggler, dict(enabled=True, report_time_interval=0), "report_time_interval must be positive"),
    (_straggler, BridgeStraggler, dict(enabled=True, gpu_relative_perf_threshold=1.5),
     "gpu_relative_perf_threshold must be between 0.0 and 1.0"),
    (_straggler, BridgeStraggler, dict(enabled=True, gpu_individual_perf_threshold=-0.1),
     "gpu_individual_perf_threshold must be between 0.0 and 1.0"),
    (_straggler, BridgeStraggler, dict(enabled=True, calc_relative_gpu_perf=False, calc_individual_gpu_perf=False),
     "At least one of calc_relative_gpu_perf or calc_individual_gpu_perf must be True when NVRx "
     "straggler detection is enabled"),
    (_simulated, BridgeFT, dict(simulate_fault=True, simulated_fault_type="rank_exception"),
     "Unknown fault type rank_exception expected one of: rank_killed, rank_hung"),
    # ours, not Bridge's: a threshold of 0 never flags; the other classes' rules
    (_straggler, BridgeStraggler, dict(enabled=True, gpu_relative_perf_threshold=0.0),
     "gpu_relative_perf_threshold=0.0: must be in (0, 1]"),
    (_inprocess, BridgeInProcess, dict(enabled=True, soft_timeout=95.0), "soft_timeout < hard_timeout"),
    (_inprocess, BridgeInProcess, dict(enabled="yes"), "enabled='yes': must be true or false"),
    (_rerun, BridgeRerun, dict(rerun_mode="report_stats"), "now calls this mode 'report_determinism_stats'"),
    (_rerun, BridgeRerun, dict(error_injection_type="bitflip"), "one of 'correct_result'"),
]
PREFIX = {BridgeStraggler: "NVRxStragglerDetectionConfig", BridgeFT: "FaultToleranceConfig",
          BridgeInProcess: "InProcessRestartConfig", BridgeRerun: "RerunStateMachineConfig"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hook, cls, fields, words", ERRORS, ids=[e[3][:40] for e in ERRORS])
def test_each_rule_is_worded_and_names_bridges_class(kind, hook, cls, fields, words):
    with pytest.raises(ConfigError) as raised:
        hook(shaped(kind, cls, **fields))
    assert str(raised.value).startswith(f"{PREFIX[cls]}: ") and words in str(raised.value), str(raised.value)


def test_ft_setup_without_a_save_dir_says_so_in_bridges_words(tmp_path):
    cfg = SimpleNamespace(ft=BridgeFT(enable_ft_package=True), checkpoint=SimpleNamespace(save=None))
    with pytest.raises(ValueError, match="checkpointing save dir must be set to enable fault tolerance"):
        ft.setup(cfg, SimpleNamespace(cfg=cfg, rank_monitor_client=None))


def test_the_wrong_object_is_refused_not_taken_for_all_defaults():
    container = SimpleNamespace(ft=BridgeFT(), nvrx_straggler=BridgeStraggler())  # the container, not a section
    for hook, name in [(_straggler, "NVRxStragglerDetectionConfig"), (_simulated, "FaultToleranceConfig"),
                       (_inprocess, "InProcessRestartConfig"), (_rerun, "RerunStateMachineConfig")]:
        with pytest.raises(TypeError, match=f"expected an object with {name}'s fields"):
            hook(container)
