"""nvrx report on event timelines written out by hand: each verdict rule, the goodput split,
and a damaged events file. (tests/test_report_runs.py checks the same on real runs.)"""

import json

import pytest

from nvrx_core.cli import main as nvrx
from nvrx_core.report import attribution as a
from nvrx_core.report.build import build_report
from nvrx_core.report.events_file import load
from nvrx_core.report.goodput import goodput
from nvrx_core.report.incidents import find_incidents


def e(t, kind, cycle=None, rank=None, **fields):
    return {"time": float(t), "kind": kind, "cycle": cycle, "rank": rank, **fields}


def write(path, events, tail=b""):
    path.write_bytes(b"".join(json.dumps(x).encode() + b"\n" for x in events) + tail)
    return path


STACK = ('Thread 0x1 (most recent call first):\n  File "/x/client_link.py", line 152 in _run\n\n'
         'Current thread 0x2 (most recent call first):\n  File "/x/faults.py", line 109 in _fire\n'
         '  File "/x/train.py", line 110 in main\n')


def cycle_start(t, cycle):
    return [e(t, "workers_started", cycle), e(t + 0.1, "training_resumed", cycle, rank=0, step=10 * cycle)]


def hang_cycle(states, answers, stacks=None):
    """Cycle 0 of two ranks with a hang detected at t=10: `states` {rank: process state},
    `answers` {rank: enqueued in default_pg (None: waiting op absent)}."""
    events = cycle_start(0, 0) + [
        e(10, "hang_evidence", 0, rank=0, ranks={
            str(r): {"process": s, "silent_s": 2.0, "last_progress_time": 8.0 + r * 0.001, "open_sections": []}
            for r, s in states.items()}),
        e(10.001, "fault_detected", 0, rank=0, fault="hang", reason="heartbeat timeout"),
    ]
    for rank, enqueued in answers.items():
        front = max(answers.values())
        op = "gloo:all_reduce" if enqueued == front else None
        events.append(e(10.01, "collectives_reported", 0, rank=rank, groups={
            "default_pg": {"enqueued": enqueued, "completed": enqueued - 1, "op": op}}))
    for rank, text in (stacks or {}).items():
        events.append(e(10.2, "stacks_reported", 0, rank=rank, stacks=text))
    return events + [e(10.3, "workers_failed", 0, exit_codes={"0": -9})] + cycle_start(11, 1)


def verdict(events):
    [incident] = find_incidents(events)
    return incident.verdict


def test_a_gil_free_hang_blames_the_rank_that_never_entered_the_collective():
    v = verdict(hang_cycle({0: "sleeping", 1: "sleeping"}, {0: 28, 1: 26}, stacks={1: STACK}))
    assert (v.kind, v.culprits, v.waiting) == (a.HANG, [1], [0])
    assert v.basis.startswith("collective sequence")
    assert any("_fire (faults.py:109) < main (train.py:110)" in line for line in v.evidence)
    assert any("in gloo:all_reduce #28" in line for line in v.evidence)


def test_a_rank_that_holds_the_gil_cannot_answer_and_is_blamed():
    v = verdict(hang_cycle({0: "sleeping", 1: "running"}, {0: 28}))
    assert (v.kind, v.culprits, v.waiting) == (a.HANG_GIL, [1], [0])


def test_a_stopped_rank_is_blamed_as_stopped():
    v = verdict(hang_cycle({0: "sleeping", 1: "stopped"}, {0: 28}))
    assert (v.kind, v.culprits, v.waiting) == (a.STOPPED, [1], [0])


def test_every_rank_in_the_same_collective_blames_no_rank_here():
    v = verdict(hang_cycle({0: "sleeping", 1: "sleeping"}, {0: 28, 1: 28}))
    assert (v.kind, v.culprits, v.waiting) == (a.COLLECTIVE_HANG, [], [0, 1])


def test_without_collective_records_the_first_silent_rank_is_blamed():
    events = [x for x in hang_cycle({0: "sleeping", 1: "sleeping"}, {}) if x["kind"] != "collectives_reported"]
    for x in events:  # rank 1 fell silent two seconds before rank 0
        if x["kind"] == "hang_evidence":
            x["ranks"]["1"]["last_progress_time"] = 6.0
    v = verdict(events)
    assert (v.kind, v.culprits) == (a.HANG, [1]) and v.basis == "heartbeat and section records"


def crash_cycle(codes, exceptions=(), stopped=()):
    events = cycle_start(0, 0)
    for t, rank, type_name, message in exceptions:
        events.append(e(t, "worker_exception", 0, rank=rank, type=type_name, message=message,
                        traceback=f'  File "/x/train.py", line 7, in step\n{type_name}: {message}\n'))
    failed = e(5, "workers_failed", 0, exit_codes={str(r): c for r, c in codes.items()}, stopped_ranks=list(stopped))
    return events + [failed] + cycle_start(6, 1)


def test_a_killed_rank_is_blamed_and_the_peer_whose_collective_broke_is_waiting():
    v = verdict(crash_cycle({0: 1, 1: -9}, [(4.9, 0, "torch.distributed.DistBackendError",
                                             "[gloo] Connection closed by peer [127.0.0.1]:4242")]))
    assert (v.kind, v.culprits, v.waiting) == (a.KILLED, [1], [0])
    assert any("SIGKILL" in line for line in v.evidence)


def test_the_rank_that_raised_first_is_blamed_not_the_peer_that_failed_after_it():
    v = verdict(crash_cycle({0: 1, 1: 1}, [
        (4.0, 0, "nvrx_core.ft.faults.SimulatedFaultError", "simulated fault in rank 0 at iteration 12"),
        (4.1, 1, "RuntimeError", "[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]: Connection reset by peer")]))
    assert (v.kind, v.culprits, v.waiting) == (a.EXCEPTION, [0], [1])
    assert any("SimulatedFaultError" in line and "step (train.py:7)" in line for line in v.evidence)


@pytest.mark.parametrize("killed_seen_at", [4.0, 4.7])  # the monitor may see the killed rank's socket close last
def test_a_rank_that_vanished_with_no_exception_is_the_one_killed(killed_seen_at):
    events = crash_cycle({0: 1}, [(4.5, 0, "torch.distributed.DistBackendError",
                                   "[gloo] Connection closed by peer [127.0.0.1]:4242")])
    events[2:2] = [e(killed_seen_at, "rank_disconnected", 0, rank=1), e(4.6, "rank_disconnected", 0, rank=0)]
    v = verdict(events)
    assert (v.kind, v.culprits, v.waiting) == (a.KILLED, [1], [0])


def test_a_peer_stopped_after_the_raising_rank_failed_is_not_blamed():
    """torch stops the other workers before the agent reports the failure: rank 1's
    connection drops after rank 0 raised and exited, still before workers_failed."""
    events = crash_cycle({0: 1}, [(4.0, 0, "nvrx_core.ft.faults.SimulatedFaultError", "simulated fault")])
    events[3:3] = [e(4.05, "rank_disconnected", 0, rank=0), e(4.09, "rank_disconnected", 0, rank=1)]
    v = verdict(events)
    assert (v.kind, v.culprits) == (a.EXCEPTION, [0]), v


def test_a_rank_the_launcher_stopped_before_its_collective_broke_is_not_blamed():
    """torch's poll saw rank 1 killed and terminated rank 0 before rank 0's gloo call failed:
    rank 0's SIGTERM is the launcher's stop (seen in a loaded CI run: blamed [0, 1] before)."""
    events = crash_cycle({1: -9, 0: -15}, stopped=[0])
    events[2:2] = [e(4.0, "rank_disconnected", 0, rank=1), e(4.02, "rank_disconnected", 0, rank=0)]
    v = verdict(events)
    assert (v.kind, v.culprits, v.waiting) == (a.KILLED, [1], [0]), v
    assert any("rank 0: stopped by the launcher (SIGTERM)" in line for line in v.evidence)


def test_a_rank_the_launcher_stopped_that_only_vanished_is_not_blamed():
    """Warm start: torch lists only the failed rank; the rank its poll terminated just vanishes."""
    events = crash_cycle({1: 1}, stopped=[0])
    events[2:2] = [e(4.0, "rank_disconnected", 0, rank=0)]
    v = verdict(events)
    assert (v.kind, v.culprits) == (a.EXITED, [1]), v


def test_preemption_blames_no_rank():
    events = cycle_start(0, 0) + [
        e(3, "preemption_agreed", 0, rank=0, step=12, signals_here=["SIGTERM"]),
        e(3.5, "workers_failed", 0, exit_codes={"0": 18, "1": 18}), e(4, "launcher_exit", exit_code=18)]
    v = verdict(events)
    assert (v.kind, v.culprits) == (a.PREEMPTED, []) and "SIGTERM" in v.evidence[0]


def test_a_preemption_the_launcher_was_signalled_for_is_no_failed_cycle():
    """Slurm's warning reached the launcher; every rank saved and exited 18: the scheduler took
    the job, nothing failed (a preemption seen only as a worker's exit 18 stays an incident)."""
    events = cycle_start(0, 0) + [
        e(3, "launcher_signaled", 0, signal="SIGTERM", running_ranks=[0, 1], preempted=True,
          exit_codes={"0": 18, "1": 18}),
        e(3.1, "preemption_agreed", 0, rank=0, step=12, signals_here=["SIGTERM"]),
        e(4, "launcher_exit", exit_code=18, process_exit_code=0)]
    assert find_incidents(events) == []


def test_a_stop_signal_the_workers_did_not_handle_blames_no_rank():
    events = cycle_start(0, 0) + [
        e(3, "launcher_signaled", 0, signal="SIGTERM", running_ranks=[0, 1], preempted=False,
          exit_codes={"0": -15, "1": -15}),
        e(4, "launcher_exit", exit_code=143)]
    [incident] = find_incidents(events)
    assert (incident.verdict.kind, incident.verdict.culprits, incident.verdict.waiting) == (a.SIGNALED, [], [])
    assert "SIGTERM" in incident.verdict.evidence[0] and incident.detected_time == 3


def test_a_straggler_stop_blames_the_straggler():
    events = cycle_start(0, 0) + [
        e(3, "straggler_found", 0, rank=0, straggler_rank=1, straggler_node="n1", score_kind="relative",
          scope="overall", score=0.4, threshold=0.7, consecutive=3, action="stop"),
        e(3.5, "workers_failed", 0, exit_codes={"0": 19, "1": 19}), e(4, "launcher_exit", exit_code=19)]
    v = verdict(events)
    assert (v.kind, v.culprits, v.node) == (a.STRAGGLER, [1], "n1")


def test_a_lost_node_is_named_from_the_rendezvous_events():
    events = cycle_start(0, 0) + [
        e(3, "node_lost", agent="n0", lost_agent="n1", round=1, seen_by="watcher"),
        e(3.5, "workers_failed", 0, exit_codes={"0": 1})] + cycle_start(5, 1)
    v = verdict(events)
    assert (v.kind, v.culprits, v.node, v.waiting) == (a.NODE_LOST, [], "n1", [0])


def test_incident_timings_and_goodput_add_up():
    events = [e(-2.0, "launcher_started", process_started=-3.0)] + cycle_start(0, 0)
    events += [e(0.1 + 0.5 * i, "step_done", 0, rank=0, step=i) for i in range(1, 13)]  # 0.5 s steps
    events += [e(6.4, "worker_exception", 0, rank=1, type="ValueError", message="bad batch"),
               e(6.7, "workers_failed", 0, exit_codes={"1": 1}), e(6.8, "restart_begun", 1),
               e(7.2, "workers_started", 1), e(8.0, "training_resumed", 1, rank=0, step=10)]
    events += [e(8.0 + 0.5 * i, "step_done", 1, rank=0, step=10 + i) for i in range(1, 11)]
    events += [e(8.9, "checkpoint_committed", 1, rank=0, step=12)]  # step 12 took 0.4 s longer
    events += [e(13.5, "training_finished", 1), e(14.4, "launcher_exit", exit_code=0)]
    events = sorted(events, key=lambda x: x["time"])
    for x in events:
        if x["kind"] == "step_done" and x["cycle"] == 1 and x["step"] >= 12:
            x["time"] += 0.4
    [incident] = find_incidents(events)
    assert incident.verdict.culprits == [1] and incident.steps_redone == 2
    assert incident.detect_s == pytest.approx(0.3) and incident.stop_s == pytest.approx(0.1)
    assert incident.restart_s == pytest.approx(0.4) and incident.first_step_s == pytest.approx(1.3)
    g = goodput(events, [incident])
    assert g.wall_s == pytest.approx(17.4) and g.steps_kept == 20 and g.steps_redone == 2
    assert g.seconds["startup"] == pytest.approx(3.1)
    assert g.seconds["productive"] == pytest.approx(20 * 0.5)
    assert g.seconds["checkpoint"] == pytest.approx(0.4)
    assert g.seconds["redone"] == pytest.approx(2 * 0.5 + 0.3)  # steps 11, 12 and the part-step before the fault
    assert g.seconds["detection"] == pytest.approx(0.3) and g.seconds["restart"] == pytest.approx(1.3)
    assert g.seconds["shutdown"] == pytest.approx(1.0)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s) and g.seconds["other"] == pytest.approx(0.0, abs=1e-9)
    assert g.ettr == pytest.approx(10.0 / 17.4)


def test_every_attempt_of_a_requeued_job_in_one_file_is_told_apart():
    """Two attempts of a 2-node Slurm job appending to one file; all four launchers on one host
    name (a one-host test cluster), each counting cycles from 0. Attempt 1 loses a node after
    step 8, Slurm requeues, attempt 2 resumes from step 5's checkpoint and finishes."""
    def node(launcher, start, *records):
        return [e(start + 0.5, "launcher_started", process_started=start, node="n", launcher=launcher),
                *({**r, "node": "n", "launcher": launcher} for r in records)]

    events = node("a1", 0.0, e(1, "workers_started", 0), e(2, "training_resumed", 0, rank=0, step=0),
                  *(e(2 + i, "step_done", 0, rank=0, step=i) for i in range(1, 9)),
                  e(10.5, "workers_failed", 0, exit_codes={"0": 1}), e(11, "launcher_exit", exit_code=1))
    events += node("b1", 0.2, e(1, "workers_started", 0), e(10.2, "step_done", 0, rank=2, step=8))  # then lost
    events += node("a2", 20.0, e(21, "workers_started", 0), e(22, "training_resumed", 0, rank=0, step=5),
                   *(e(17 + i, "step_done", 0, rank=0, step=i) for i in range(6, 11)),
                   e(27.2, "training_finished", 0), e(28, "launcher_exit", exit_code=0))
    events += node("b2", 20.1, e(21, "workers_started", 0), e(28, "launcher_exit", exit_code=0))
    events = sorted(events, key=lambda x: x["time"])
    [incident] = find_incidents(events)
    assert incident.key[1:] == ("a1", 0) and incident.last_step == 8
    g = goodput(events, [incident])
    assert g.wall_s == pytest.approx(28.0) and (g.steps_kept, g.steps_redone) == (10, 3)  # 6-8 ran twice
    assert g.seconds["requeue"] == pytest.approx(20.0 - 11.0)
    assert g.seconds["startup"] == pytest.approx(2.0 + 2.0)  # each attempt's launch to its training
    assert g.seconds["productive"] == pytest.approx(10.0) and g.ettr == pytest.approx(10.0 / 28.0)
    assert g.seconds["redone"] == pytest.approx(3.0 + 0.5)  # and the part-step before the failure
    assert g.seconds["shutdown"] == pytest.approx(1.0)
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)


def test_a_damaged_events_file_is_reported_line_by_line_and_the_rest_analysed(tmp_path, capsys):
    good = crash_cycle({1: -9})
    path = tmp_path / "events.jsonl"
    lines = [json.dumps(x) for x in good]
    lines.insert(1, "{not json")
    lines.insert(2, "[1, 2]")
    lines.insert(3, json.dumps({"time": 1.0}))
    lines.insert(4, json.dumps({"time": "noon", "kind": "step_done"}))
    lines.insert(5, json.dumps({"time": 1.5, "kind": "step_done", "cycle": 0, "rank": 0, "step": 1, "v": 7}))
    lines.insert(6, json.dumps({"time": 1.6, "kind": "step_done", "cycle": "zero", "rank": 0, "step": 2}))
    path.write_text("\n".join(lines) + '\n{"time": 9.0, "kind": "step_')
    loaded = load(str(path))
    reasons = {p.line: p.reason for p in loaded.problems}
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, len(lines) + 1]
    assert "not JSON" in reasons[2] and "not an event object" in reasons[3] and "no 'kind'" in reasons[4]
    assert "not a number" in reasons[5] and "newer than this reader's" in reasons[6]
    assert "'cycle' is 'zero'" in reasons[7] and "truncated" in reasons[len(lines) + 1]
    assert [i.verdict.culprits for i in find_incidents(loaded.events)] == [[1]]
    assert nvrx(["report", str(tmp_path)]) == 0  # a run directory
    out = capsys.readouterr().out
    assert "rank killed: culprit rank 1" in out and f"events.jsonl:{len(lines) + 1}: truncated" in out


def test_report_command_errors_name_the_problem(tmp_path, capsys):
    assert nvrx(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such events file or run directory" in capsys.readouterr().err
    assert nvrx(["report", str(tmp_path)]) == 2
    assert "no events file" in capsys.readouterr().err


def test_report_picture(tmp_path):
    pytest.importorskip("matplotlib", reason="the picture is the optional [report] extra")
    events = crash_cycle({1: -9}) + [e(6.5 + i, "straggler_scores", 1, rank=0, scores={"0": 1.0, "1": 0.8})
                                     for i in range(3)]
    path = write(tmp_path / "events.jsonl", events)
    report = build_report(str(path))
    from nvrx_core.report.plot import write_html, write_png

    write_png(report, str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_html(report, str(tmp_path / "r.html"))
    page = (tmp_path / "r.html").read_text()
    assert "data:image/png;base64," in page and "culprit rank 1" in page
