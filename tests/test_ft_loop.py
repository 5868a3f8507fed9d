"""nvrx_core.ft.loop.MonitoredLoop, the one training-loop protocol every adapter maps onto: a loop
driven call by call against a real node monitor (served from a thread of this process), and the
two learning rules decided from recorded progress alone."""

import json
import os

import pytest

from harness.node_monitor import NodeMonitorOnThread
from nvrx_core import collectives
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.learning_rules import (AFTER_SAVE, BEFORE_SAVE, END, STARTUP_TIMEOUTS, AfterFirstSave,
                                         LoopProgress, PerTimeoutEvidence)
from nvrx_core.ft.loop import MonitoredLoop, SectionRule
from harness import wait_for

SECTIONS = dict(rank_section_timeouts={"setup": 60, "step": 30, "checkpointing": 30}, rank_out_of_section_timeout=30,
                initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None)
HEARTBEATS = dict(initial_rank_heartbeat_timeout=60, rank_heartbeat_timeout=30)
BRIDGE = SectionRule(first_step_in_setup=False, eval_warmup_steps=1, eval_ends_setup=True)


@pytest.fixture
def monitor(tmp_path, monkeypatch, request):
    config = FTConfig(stack_dump_grace=0.05, safety_factor=5, min_calculated_timeout=1.0,
                      **getattr(request, "param", SECTIONS))
    m = NodeMonitorOnThread(tmp_path, config=config, send_signal=lambda watch, sig: True)
    monkeypatch.setenv("NVRX_FT_MONITOR_SOCKET", m.path)
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(tmp_path / "finished"))
    yield m
    m.close()


def seen(monitor, loop, heartbeats):
    """The monitor's view of this rank once it has taken `heartbeats` heartbeats (every call
    before a heartbeat arrived before it: one socket, in order)."""
    watch = monitor.watch(os.getpid())
    wait_for(lambda: watch.heartbeats >= heartbeats, what=f"{heartbeats} heartbeats")
    return set(watch.open_sections)


def test_lightning_shaped_sections_keep_the_first_step_and_a_sanity_check_in_setup(tmp_path, monitor):
    loop = MonitoredLoop(str(tmp_path), rank=0, world_size=1)
    assert loop.begin()
    loop.eval_step_begin()
    loop.eval_step_end()                            # a sanity check: still the start-up
    loop.client.send_heartbeat()
    assert seen(monitor, loop, 1) == {"setup"}
    loop.step_begin(0)
    loop.client.send_heartbeat()
    assert seen(monitor, loop, 2) == {"setup"}      # the first (compiling) step is the start-up's
    loop.step_end(1)
    assert seen(monitor, loop, 3) == set()
    loop.step_begin(1)
    loop.client.send_heartbeat()
    assert seen(monitor, loop, 4) == {"step"}
    loop.step_end(2)
    loop.eval_step_begin()
    loop.client.send_heartbeat()
    assert seen(monitor, loop, 6) == {"step"}       # validation after training began: a step
    loop.eval_step_end()
    loop.checkpoint_begin()
    loop.client.send_heartbeat()
    assert seen(monitor, loop, 9) == {"checkpointing"}
    loop.checkpoint_end()
    assert seen(monitor, loop, 10) == set()
    assert monitor.watch(os.getpid()).max_iteration == 2
    loop.fail()


def test_bridge_shaped_sections_leave_each_first_step_outside_step(tmp_path, monitor):
    loop = MonitoredLoop(str(tmp_path), rank=0, world_size=1, sections=BRIDGE)
    assert loop.begin()
    loop.eval_step_begin()                          # an evaluation before training ends the start-up
    loop.client.send_heartbeat()
    assert seen(monitor, loop, 1) == set()          # and its first step is a warm-up
    loop.eval_step_end()
    loop.eval_step_begin()
    loop.client.send_heartbeat()
    assert seen(monitor, loop, 3) == {"step"}
    loop.eval_step_end()
    loop.step_begin(0)
    loop.client.send_heartbeat()
    assert seen(monitor, loop, 5) == set()          # the first training step: no section
    loop.step_end(1)
    loop.step_begin(1)
    loop.client.send_heartbeat()
    assert seen(monitor, loop, 7) == {"step"}
    loop.step_end(2)
    loop.eval_step_begin()                          # a new evaluation warms up again
    loop.client.send_heartbeat()
    assert seen(monitor, loop, 9) == set()
    loop.fail()


@pytest.mark.parametrize("monitor", [HEARTBEATS], indirect=True)
def test_a_heartbeat_only_monitor_gets_heartbeats_and_no_section(tmp_path, monitor):
    loop = MonitoredLoop(str(tmp_path), rank=0, world_size=1)
    assert loop.begin()
    for step in range(3):
        loop.step_begin(step)
        loop.step_end(step + 1)
    seen(monitor, loop, 3)
    watch = monitor.watch(os.getpid())
    assert not watch.uses_sections and watch.section_ends == 0
    loop.fail()


def run(loop, steps, save_every):
    for step in range(steps):
        loop.step_begin(step)
        loop.step_end(step + 1)
        if (step + 1) % save_every == 0:
            loop.checkpoint_begin()
            loop.checkpoint_end()


def learned(tmp_path):
    return json.loads((tmp_path / "ft_state.json").read_text())["calculated_timeouts"]


def test_a_clean_end_learns_writes_the_state_dir_and_the_finished_flag_on_rank_zero_only(tmp_path, monitor):
    loop = MonitoredLoop(str(tmp_path), rank=0, world_size=1, rule=AfterFirstSave())
    assert loop.begin()
    run(loop, 6, save_every=2)
    assert loop.progress.learned                    # before the second save, so it is in that checkpoint
    loop.finish(completed=True)
    assert (tmp_path / "finished").exists()
    assert learned(tmp_path)["sections"]["step"] is not None
    assert learned(tmp_path)["sections"]["setup"] is None       # a fresh start: no start-up timeout
    wait_for(lambda: monitor.watch(os.getpid()) is None, what="goodbye")

    (tmp_path / "finished").unlink()
    other = MonitoredLoop(str(tmp_path / "rank1"), rank=1, world_size=1, rule=AfterFirstSave())
    assert other.begin()
    run(other, 4, save_every=2)
    other.finish(completed=True)
    assert not (tmp_path / "finished").exists() and not (tmp_path / "rank1").exists()


def test_a_failure_learns_nothing_runs_no_collective_and_writes_no_flag(tmp_path, monitor, monkeypatch):
    calls = []
    monkeypatch.setattr(collectives, "all_reduce_max", lambda *a, **k: calls.append(a))
    loop = MonitoredLoop(str(tmp_path), rank=0, world_size=1, rule=PerTimeoutEvidence(min_steps=2))
    assert loop.begin()
    run(loop, 4, save_every=100)
    loop.step_begin(4)
    loop.fail()
    assert calls == [] and not (tmp_path / "finished").exists() and not (tmp_path / "ft_state.json").exists()
    wait_for(lambda: monitor.watch(os.getpid()) is None, what="goodbye")


def test_learned_timeouts_in_a_checkpoint_merge_by_the_larger_value(tmp_path, monitor):
    loop = MonitoredLoop(str(tmp_path), rank=0, world_size=1, rule=AfterFirstSave())
    assert loop.begin()
    run(loop, 6, save_every=2)
    kept = loop.state_dict()
    step = kept["calculated_timeouts"]["sections"]["step"]
    bigger = json.loads(json.dumps(kept))
    bigger["calculated_timeouts"]["sections"]["step"] = step + 100
    loop.load_state_dict(bigger)
    assert loop.state_dict()["calculated_timeouts"]["sections"]["step"] == step + 100
    loop.load_state_dict(kept)                      # a smaller value shrinks nothing
    assert loop.state_dict()["calculated_timeouts"]["sections"]["step"] == step + 100
    loop.fail()


def test_outside_ft_launcher_every_call_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.delenv("NVRX_FT_MONITOR_SOCKET", raising=False)
    monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(tmp_path / "finished"))
    loop = MonitoredLoop(str(tmp_path), rank=0, world_size=1, rule=AfterFirstSave())
    assert not loop.begin()
    run(loop, 4, save_every=2)
    loop.finalizing()
    loop.finish(completed=True)
    assert os.listdir(tmp_path) == [] and loop.state_dict() == {}


# ---- the rules, from recorded progress -------------------------------------------------------

def test_after_first_save_learns_before_the_second_save_and_at_the_end():
    rule = AfterFirstSave()
    fresh = LoopProgress(steps=5, saves=0)
    assert rule.exclusions(BEFORE_SAVE, fresh) is None          # no save seen yet
    assert rule.exclusions(BEFORE_SAVE, LoopProgress(steps=5, saves=1)) == STARTUP_TIMEOUTS
    assert rule.exclusions(BEFORE_SAVE, LoopProgress(steps=5, saves=1, restored=True)) == ()
    assert rule.exclusions(BEFORE_SAVE, LoopProgress(steps=5, saves=2, learned=True)) is None
    assert rule.exclusions(AFTER_SAVE, LoopProgress(steps=5, saves=1)) is None
    assert rule.exclusions(END, LoopProgress(steps=1, saves=1)) is None          # too few steps
    assert rule.exclusions(END, LoopProgress(steps=5, saves=0, saves_expected=False)) == STARTUP_TIMEOUTS


def test_per_timeout_evidence_is_bridges_rule():
    rule = PerTimeoutEvidence(min_steps=16)
    assert rule.exclusions(BEFORE_SAVE, LoopProgress(steps=20, saves=1)) is None
    early = rule.exclusions(AFTER_SAVE, LoopProgress(steps=3, saves=1))
    assert set(early) == {"setup", "initial_heartbeat", "step", "heartbeat", "out_of_section"}
    later = rule.exclusions(AFTER_SAVE, LoopProgress(steps=20, saves=1, restored=True))
    assert later == ("out_of_section",)                          # only ever at the end
    assert rule.exclusions(END, LoopProgress(steps=20, saves=1, restored=True)) == ()
    async_saves = rule.exclusions(END, LoopProgress(steps=20, saves=1, restored=True, async_saves=True))
    assert async_saves == ("checkpointing",)
