"""FTConfig, the wire protocol, timeout bookkeeping and the stop-signal rule, tested on their own."""

import logging
import os
import signal

import pytest

from nvrx_core.config import ConfigError
from nvrx_core.ft import stop_signal
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.monitor import RankWatch, next_deadline
from nvrx_core.ft.protocol import MAX_MESSAGE_BYTES, LineBuffer, ProtocolError, decode, encode
from nvrx_core.ft.timeouts import IntervalObserver, Timeouts, scale
from harness import wait_for


# ---- config -------------------------------------------------------------------
def test_config_layers_defaults_yaml_cli(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "model: {hidden: 3}\n"
        "trainer:\n  fault_tolerance:\n    rank_heartbeat_timeout: 30\n    safety_factor: 8\n"
        "    rank_section_timeouts: {setup: 600, step: null}\n    rank_termination_signal: SIGTERM\n"
    )
    cfg = FTConfig.from_layers(str(path), {"safety_factor": "10"})
    assert cfg.rank_heartbeat_timeout == 30.0  # YAML over default
    assert cfg.safety_factor == 10.0  # CLI over YAML
    assert cfg.initial_rank_heartbeat_timeout == 3600.0  # default kept
    assert cfg.rank_section_timeouts == {"setup": 600.0, "step": None}
    assert cfg.rank_termination_signal == signal.SIGTERM


def test_config_cli_spellings_and_round_trip():
    cfg = FTConfig(rank_section_timeouts="setup:600, step:180,checkpointing:None",
                   rank_termination_signal="9", log_level="debug", rank_out_of_section_timeout="null")
    assert FTConfig(rank_termination_signal="TERM", stack_dump_signal="usr1").to_json()["rank_termination_signal"] == "SIGTERM"
    assert cfg.rank_section_timeouts == {"setup": 600.0, "step": 180.0, "checkpointing": None}
    assert cfg.rank_termination_signal == signal.SIGKILL
    assert cfg.rank_out_of_section_timeout is None
    assert FTConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("field, value, needle", [
    ("rank_heartbeat_timeout", 0, "rank_heartbeat_timeout=0"),
    ("initial_rank_heartbeat_timeout", "soon", "not a number"),
    ("safety_factor", 0.9, "safety_factor=0.9"),
    ("workload_check_interval", -1, "workload_check_interval"),
    ("rank_section_timeouts", {"step": -3}, "rank_section_timeouts[step]"),
    ("rank_section_timeouts", ":5", "rank_section_timeouts"),
    ("stack_dump_signal", "SIGKILL", "must be a signal a process can handle"),
    ("log_level", "LOUD", "log_level"),
    ("num_warmup_iterations", -1, "num_warmup_iterations"),
    ("min_calculated_timeout", -1, "min_calculated_timeout=-1"),
])
def test_config_rejects_bad_values_naming_the_field(field, value, needle):
    with pytest.raises(ConfigError) as err:
        FTConfig(**{field: value})
    assert needle in str(err.value)


def test_config_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="has no 'fault_tolerance:' section"):
        (tmp_path / "a.yaml").write_text("other: 1\n")
        FTConfig.from_layers(str(tmp_path / "a.yaml"))
    with pytest.raises(ConfigError, match="unknown field 'rank_heartbeat'"):
        (tmp_path / "b.yaml").write_text("fault_tolerance:\n  rank_heartbeat: 3\n")
        FTConfig.from_layers(str(tmp_path / "b.yaml"))


def test_peer_only_fields_are_accepted_and_ignored(tmp_path):
    (tmp_path / "c.yaml").write_text("fault_tolerance:\n  enable_nic_monitor: false\n  safety_factor: 2\n")
    assert FTConfig.from_layers(str(tmp_path / "c.yaml")).safety_factor == 2.0


# ---- protocol -----------------------------------------------------------------
def test_protocol_round_trip_and_validation():
    assert decode(encode("ss", name="step").rstrip(b"\n")) == {"v": 1, "t": "ss", "name": "step"}
    for bad, needle in [
        (b"not json", "not JSON"),
        (b"[1,2]", "not a JSON object"),
        (b'{"v": 2, "t": "hb"}', "protocol version"),
        (b'{"v": 1, "t": "launch_missiles"}', "unknown message type"),
        (b'{"v": 1, "t": "init", "rank": true, "local_rank": 0, "pid": 1, "cycle": 0}', "'rank' must be int"),
        (b'{"v": 1, "t": "ss", "name": 5}', "'name' must be str"),
    ]:
        with pytest.raises(ProtocolError, match=needle):
            decode(bad)
    with pytest.raises(ProtocolError, match="exceeds"):
        encode("ss", name="x" * MAX_MESSAGE_BYTES)


def test_line_buffer_drops_oversized_and_garbage_but_keeps_going():
    buf = LineBuffer(max_bytes=100)
    out = buf.feed(b"garbage\n" + encode("hb")[:5])
    assert out[0][0] is None and "not JSON" in out[0][1]
    assert buf.feed(encode("hb")[5:]) == [({"v": 1, "t": "hb"}, None)]
    huge = b"x" * 250  # arrives in pieces, with no newline for a while
    problems = buf.feed(huge[:150]) + buf.feed(huge[150:] + b"\n" + encode("sea"))
    assert [m for m, _ in problems if m] == [{"v": 1, "t": "sea"}]
    assert sum(1 for m, p in problems if p and "longer than" in p) == 1


# ---- deadlines and observed intervals -----------------------------------------
def watch(**timeouts):
    return RankWatch(rank=0, local_rank=0, pid=1, cycle=0, connected_at=100.0, timeouts=Timeouts(**timeouts))


def test_deadlines_heartbeat_mode():
    w = watch(initial_heartbeat=60.0, heartbeat=5.0)
    assert next_deadline(w) == (160.0, "no initial heartbeat")
    w.last_heartbeat = 130.0
    assert next_deadline(w) == (135.0, "heartbeat timeout")
    assert next_deadline(watch()) is None


def test_deadlines_section_mode():
    w = watch(initial_heartbeat=60.0, heartbeat=5.0, sections={"step": 10.0, "ckpt": None}, out_of_section=3.0)
    w.uses_sections = True  # no heartbeat ever: section mode, heartbeat deadlines do not apply
    w.open_sections = {"step": 110.0, "ckpt": 111.0}
    assert next_deadline(w) == (120.0, "section 'step' timeout")
    w.open_sections = {"ckpt": 111.0}
    assert next_deadline(w) is None  # ckpt has no timeout and a section is open
    w.open_sections, w.last_section_end = {}, 150.0
    assert next_deadline(w) == (153.0, "out-of-section timeout")


def test_observer_skips_warmup_and_tracks_maxima():
    o = IntervalObserver(warmup_iterations=1)
    o.on_start(0.0)
    for t in (5.0, 15.0, 16.0, 18.0):  # first delay 5; the 10 s interval is warm-up; then 1, 2
        o.on_heartbeat(t)
    for start, end in ((20.0, 29.0), (30.0, 31.0), (35.0, 37.0)):  # first run (9 s) is warm-up
        o.on_section_start("step", start)
        o.on_section_end("step", end)
    seen = o.observed(["step", "ckpt"])
    assert seen.initial_heartbeat == 5.0 and seen.heartbeat == 2.0
    assert seen.sections == {"step": 2.0, "ckpt": None}
    assert seen.out_of_section == 4.0  # 31 -> 35; the 29 -> 30 gap was warm-up
    assert scale(seen, 3).heartbeat == 6.0
    floored = scale(seen, 3, floor=7.0)  # a floor lifts the short ones, keeps the long ones, leaves None
    assert (floored.heartbeat, floored.out_of_section, floored.sections) == (7.0, 12.0, {"step": 7.0, "ckpt": None})


def test_a_section_run_once_per_process_is_learned_from_its_only_run():
    """'setup' runs once: warm-up would never let it be learned; its one run is the measure."""
    o = IntervalObserver(warmup_iterations=1)
    o.on_section_start("setup", 0.0)
    o.on_section_end("setup", 40.0)
    for start, end in ((41.0, 50.0), (51.0, 52.0)):
        o.on_section_start("step", start)
        o.on_section_end("step", end)
    assert o.observed(["setup", "step"]).sections == {"setup": 40.0, "step": 1.0}


def test_timeouts_merge_and_override():
    a = Timeouts(heartbeat=4.0, sections={"step": 2.0})
    b = Timeouts(heartbeat=3.0, sections={"step": 5.0, "ckpt": 9.0}, initial_heartbeat=7.0)
    merged = a.merged_max(b)
    assert merged == Timeouts(initial_heartbeat=7.0, heartbeat=4.0, sections={"ckpt": 9.0, "step": 5.0})
    configured = Timeouts(initial_heartbeat=3600.0, heartbeat=2700.0, sections={"step": 600.0, "setup": 60.0})
    effective = configured.overridden_by(Timeouts(heartbeat=2.0, sections={"step": 1.0, "setup": None}))
    assert effective == Timeouts(initial_heartbeat=3600.0, heartbeat=2.0, sections={"step": 1.0, "setup": 60.0})


def test_timeouts_from_untrusted_json():
    with pytest.raises(ConfigError, match="heartbeat=-1"):
        Timeouts.from_json({"heartbeat": -1})
    with pytest.raises(ConfigError, match="unknown fields"):
        Timeouts.from_json({"heartbeats": 1})
    with pytest.raises(ConfigError, match="expected an object"):
        Timeouts.from_json([1])


# ---- simulated faults ---------------------------------------------------------
def test_fault_injector_targets_one_rank_in_one_cycle():
    from nvrx_core.ft.faults import FaultInjector, SimulatedFault

    fault = SimulatedFault("rank_killed", rank_to_fail=2, at_iteration=7, cycle=1)
    assert FaultInjector(fault, rank=2, world_size=4, cycle=1).armed
    assert not FaultInjector(fault, rank=1, world_size=4, cycle=1).armed
    assert not FaultInjector(fault, rank=2, world_size=4, cycle=0).armed
    picks = {FaultInjector(SimulatedFault("random", base_delay=1.0, jitter=2.0, seed=s), rank=0, world_size=8,
                           cycle=0).kind for s in range(20)}
    assert picks == {"rank_killed", "rank_hung"}
    same = [FaultInjector(SimulatedFault("random", base_delay=1.0, jitter=2.0, seed=3), rank=r, world_size=8, cycle=0)
            for r in range(8)]
    assert len({(i.target_rank, i.kind, i.delay) for i in same}) == 1  # every rank agrees on the plan
    assert 1.0 <= same[0].delay < 3.0


def test_fault_injector_exception_fires_in_the_loop():
    from nvrx_core.ft.faults import FaultInjector, SimulatedFault, SimulatedFaultError

    injector = FaultInjector(SimulatedFault("rank_exception", rank_to_fail=0, at_iteration=3), rank=0, world_size=1,
                             cycle=0)
    injector.maybe_inject(2)
    with pytest.raises(SimulatedFaultError):
        injector.maybe_inject(3)
    injector.maybe_inject(3)  # fires once


@pytest.mark.parametrize("kwargs, needle", [
    (dict(fault_type="rank_melted", at_iteration=1), "fault_type"),
    (dict(fault_type="rank_killed"), "set exactly one"),
    (dict(fault_type="rank_killed", at_iteration=1, base_delay=1.0), "set exactly one"),
    (dict(fault_type="rank_exception", base_delay=1.0), "use at_iteration"),
    (dict(fault_type="rank_hung", base_delay=-1.0), "base_delay"),
])
def test_simulated_fault_validation(kwargs, needle):
    from nvrx_core.ft.faults import SimulatedFault

    with pytest.raises(ConfigError, match=needle):
        SimulatedFault(**kwargs)


@pytest.mark.parametrize("codes,expected", [
    ({0: 18, 1: 18}, True),
    ({0: 18, 1: -signal.SIGKILL}, True),   # killed after the grace: no veto on the rank that saved
    ({0: 18, 1: None}, True),              # still alive after SIGKILL (uninterruptible sleep)
    ({0: -signal.SIGTERM, 1: -signal.SIGTERM}, False),  # no rank handled it
    ({0: 18, 1: 1}, False),
    ({0: 18, 1: 0}, False),
    ({}, True),                            # no worker was started (a hot spare): nothing to save
])
def test_a_stop_signal_is_a_preemption_when_every_worker_that_exited_on_its_own_saved(codes, expected):
    assert stop_signal.preempted(codes) is expected
    stop = stop_signal.SignalStop(signal.SIGTERM, [0, 1], codes)
    assert stop.exit_code() == (18 if expected else 143)


def test_stop_signals_raise_from_the_start_and_once_held_a_repeat_only_logs(caplog):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    assert stop_signal.handled_signals({}) == [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    assert stop_signal.handled_signals({"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGUSR1, SIGNOPE"}) == [signal.SIGUSR1]
    assert stop_signal.handled_signals({"TORCHELASTIC_SIGNALS_TO_HANDLE": "TERM,usr2,SIGTERM,"}) == [signal.SIGTERM,
                                                                                                  signal.SIGUSR2]
    before = signal.getsignal(signal.SIGUSR1)
    stops = stop_signal.StopSignals([signal.SIGUSR1])
    stops.arm()
    try:
        with pytest.raises(SignalException) as raised:
            os.kill(os.getpid(), signal.SIGUSR1)
            wait_for(lambda: False, timeout=10, what="the signal's exception")
        assert raised.value.sigval == signal.SIGUSR1
        signal.signal(signal.SIGUSR1, lambda *_: None)  # as torch's agent does when it starts workers
        stops.hold(grace=7)
        with caplog.at_level(logging.WARNING, logger="nvrx.ft.launcher"):
            os.kill(os.getpid(), signal.SIGUSR1)
            wait_for(lambda: "received SIGUSR1 again" in caplog.text, what="the repeat logged")
    finally:
        stops.release()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_once_the_run_is_settled_a_stop_signal_only_logs_even_over_torchs_handler(caplog):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def torchs(number, _frame):  # torch's agent leaves this in place after its workers ran
        raise SignalException("torch", sigval=signal.Signals(number))

    before = signal.getsignal(signal.SIGUSR2)
    stops = stop_signal.StopSignals([signal.SIGUSR2])
    stops.arm()
    try:
        signal.signal(signal.SIGUSR2, torchs)
        stops.settle()
        with caplog.at_level(logging.WARNING, logger="nvrx.ft.launcher"):
            os.kill(os.getpid(), signal.SIGUSR2)    # no exception: the exit code stands
            wait_for(lambda: "received SIGUSR2 after the run ended" in caplog.text, what="the late signal logged")
    finally:
        stops.release()
    assert signal.getsignal(signal.SIGUSR2) == before
