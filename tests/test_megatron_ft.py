"""nvrx_megatron.fault_tolerance: Bridge's hook functions against a real node monitor (served
from a thread of this process, signals recorded instead of sent), driven the way a
Bridge-style loop drives them. The multi-rank runs under ft_launcher belong with the
reference trainer."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from harness.node_monitor import NodeMonitorOnThread
from nvrx_core import collectives
from nvrx_core.ft.config import FTConfig
from nvrx_megatron import FaultToleranceConfig
from nvrx_megatron import fault_tolerance as ft
from harness import wait_for


def bridge_state(tmp_path, train_iters=20, calc=True, async_save=False):
    cfg = SimpleNamespace(
        ft=FaultToleranceConfig(enable_ft_package=True, calc_ft_timeouts=calc),
        checkpoint=SimpleNamespace(save=str(tmp_path / "ckpt"), async_save=async_save),
        train=SimpleNamespace(train_iters=train_iters),
    )
    return SimpleNamespace(cfg=cfg, train_state=SimpleNamespace(step=0), rank_monitor_client=None)


def train(state, iterations, save_every=10, step_s=0.01):
    """A Bridge-style loop: the hooks where Bridge's train() calls them."""
    for _ in range(iterations):
        ft.on_training_step_start(state)
        time.sleep(step_s)
        state.train_state.step += 1
        ft.on_training_step_end(state)
        if state.train_state.step % save_every == 0:
            ft.on_checkpointing_start(state)
            time.sleep(step_s)
            ft.on_checkpointing_end(False, state)


@pytest.fixture
def monitor(tmp_path, request):
    signalled = []
    config = FTConfig(stack_dump_grace=0.05, safety_factor=5, min_calculated_timeout=1.0,
                      **getattr(request, "param", {}))
    m = NodeMonitorOnThread(tmp_path, config=config, send_signal=lambda watch, sig: signalled.append(sig) or True)
    m.signalled = signalled
    yield m
    m.close()


SECTIONS = dict(rank_section_timeouts={"setup": 60, "step": 30, "checkpointing": 30}, rank_out_of_section_timeout=30,
                initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None)
HEARTBEATS = dict(initial_rank_heartbeat_timeout=60, rank_heartbeat_timeout=30)


@pytest.mark.parametrize("monitor", [SECTIONS, HEARTBEATS], indirect=True, ids=["sections", "heartbeats"])
def test_a_bridge_loop_is_watched_learns_timeouts_and_writes_the_finished_flag(tmp_path, monkeypatch, monitor):
    monkeypatch.setenv("NVRX_FT_MONITOR_SOCKET", monitor.path)
    flag = tmp_path / "finished"
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(flag))
    state = bridge_state(tmp_path)
    ft.setup(state.cfg, state)
    assert monitor.watch(os.getpid()) is not None
    ft.on_checkpoint_loaded(False, state)          # as after a restart from a persistent checkpoint
    train(state, 20)
    assert not flag.exists()
    ft.shutdown(state)
    assert state.rank_monitor_client is None and flag.exists()
    wait_for(lambda: monitor.watch(os.getpid()) is None, what="goodbye")
    assert monitor.signalled == []
    learned = json.loads((tmp_path / "ckpt" / "ft_state.json").read_text())["calculated_timeouts"]
    if monitor.monitor.cfg.rank_section_timeouts:   # sections learned, heartbeats left unenforced
        assert None not in learned["sections"].values() and learned["out_of_section"] is not None
        assert learned["heartbeat"] is None and learned["initial_heartbeat"] is None
    else:                                           # heartbeats learned, gaps spanning saves included
        assert learned["heartbeat"] is not None and learned["initial_heartbeat"] is not None
        assert learned["sections"] == {}


@pytest.mark.parametrize("monitor", [SECTIONS], indirect=True)
def test_a_fresh_run_does_not_learn_its_start_nor_an_async_checkpointing_section(tmp_path, monkeypatch, monitor):
    monkeypatch.setenv("NVRX_FT_MONITOR_SOCKET", monitor.path)
    state = bridge_state(tmp_path, async_save=True)
    ft.setup(state.cfg, state)
    train(state, 20)
    ft.shutdown(state)
    learned = json.loads((tmp_path / "ckpt" / "ft_state.json").read_text())["calculated_timeouts"]
    assert learned["sections"]["step"] is not None
    assert learned["sections"]["setup"] is None and learned["sections"]["checkpointing"] is None
    assert learned["out_of_section"] is None       # not every section was seen


@pytest.mark.parametrize("monitor", [SECTIONS], indirect=True)
def test_abort_runs_no_collective_and_writes_no_flag(tmp_path, monkeypatch, monitor):
    monkeypatch.setenv("NVRX_FT_MONITOR_SOCKET", monitor.path)
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(tmp_path / "finished"))
    calls = []

    def blocked_peer(values, group=None):
        calls.append(values)
        raise AssertionError("a collective on a failure path")
    monkeypatch.setattr(collectives, "all_reduce_max", blocked_peer)
    state = bridge_state(tmp_path, train_iters=20)
    ft.setup(state.cfg, state)
    train(state, 20, save_every=100)
    ft.abort(state)
    assert calls == [] and state.rank_monitor_client is None
    assert not (tmp_path / "finished").exists()
    wait_for(lambda: monitor.watch(os.getpid()) is None, what="goodbye")
    # the same state through shutdown does reach the collective: the check above can fail
    ft.setup(state.cfg, state)
    train(state, 20, save_every=100)
    with pytest.raises(AssertionError, match="a collective on a failure path"):
        ft.shutdown(state)
    assert calls and state.rank_monitor_client is None


def test_outside_ft_launcher_every_hook_is_a_warned_no_op(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("NVRX_FT_MONITOR_SOCKET", raising=False)
    state = bridge_state(tmp_path)
    with caplog.at_level("WARNING", logger="nvrx.ft.client"):
        ft.setup(state.cfg, state)
        train(state, 12)
        ft.shutdown(state)
    assert caplog.text.count("monitoring is INACTIVE") == 1
    assert not (tmp_path / "ckpt" / "ft_state.json").exists()
    disabled = bridge_state(tmp_path)
    disabled.cfg.ft = None
    train(disabled, 3)                              # cfg.ft None: nothing happens
    ft.shutdown(disabled)
    with pytest.raises(ValueError, match="checkpoint.save"):
        state.cfg.checkpoint.save = ""
        ft.setup(state.cfg, state)


def test_a_simulated_fault_fires_on_cpu_without_torch_distributed(tmp_path):
    """Bridge broadcasts the chosen rank as a CUDA tensor; here every rank derives it from one seed."""
    code = ("from nvrx_megatron import FaultToleranceConfig, fault_tolerance as ft; import time\n"
            "cfg = FaultToleranceConfig(simulate_fault=True, simulated_fault_type='rank_killed', "
            "simulated_fault_rank=1, simulated_fault_base_delay=0)\n"
            "injector = ft.maybe_setup_simulated_fault(cfg)\n"
            "time.sleep(30)\n")
    env = dict(os.environ, RANK="1", WORLD_SIZE="2")
    env.pop("NVRX_EVENTS_FILE", None)
    killed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]              # SIGKILLed itself
    assert ft.maybe_setup_simulated_fault(FaultToleranceConfig()) is None
    spared = ft.FaultInjector(FaultToleranceConfig(simulate_fault=True, simulated_fault_rank=1)
                              .to_simulated_fault(), rank=0, world_size=2)
    assert not spared.armed
    chosen = {r for r in range(4)
              if ft.FaultInjector(FaultToleranceConfig(simulate_fault=True).to_simulated_fault(), rank=r,
                                  world_size=4).armed}
    assert len(chosen) == 1                          # the same random rank on every rank
