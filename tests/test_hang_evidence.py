"""The evidence a hang report rests on: a rank's place in the collective sequence (from torch's
Flight Recorder), and the exception that ended a rank. The monitor gathering them from live
ranks is checked end to end in test_report_runs.py."""

import json
import os
import signal
import subprocess
import sys

from nvrx_core import torch_compat
from nvrx_core.events import EventLog, read_events
from nvrx_core.ft import collective_trace
from nvrx_core.ft import hang_evidence as he
from nvrx_core.ft.config import FTConfig
from nvrx_core.ft.kills import Killer, Scheduler
from nvrx_core.ft.protocol import decode
from nvrx_core.ft.timeouts import Timeouts
from nvrx_core.ft.watch import RankWatch
from nvrx_core.hang_kill import DUMP_POLL, DUMP_WAIT_LIMIT
from nvrx_core.proc import process_state
from harness import wait_for


def entry(pg_id, name, seq, op, retired):
    return {"pg_id": pg_id, "process_group": [str(pg_id), name], "collective_seq_id": seq, "is_p2p": False,
            "profiling_name": op, "retired": retired, "time_created_ns": 1000 + seq}


def test_the_flight_recorder_dump_is_reduced_to_each_groups_position():
    raw = {  # shaped like torch 2.13's _dump_fr_trace_json for a rank blocked in its 4th all_reduce
        "entries": [entry(0, "default_pg", 3, "gloo:all_reduce", True), entry(0, "default_pg", 4, "gloo:all_reduce", False),
                    entry(1, "tp", 7, "gloo:broadcast", True),
                    {"pg_id": 1, "is_p2p": True, "collective_seq_id": 0}],
        "pg_status": {"0": {"last_enqueued_collective": "4", "last_completed_collective": "3"},
                      "1": {"last_enqueued_collective": "7", "last_completed_collective": "7"},
                      "2": {"last_enqueued_collective": "x"}},  # unreadable: skipped, the rest kept
    }
    assert collective_trace.summarize_flight_recorder(raw) == {
        "default_pg": {"enqueued": 4, "completed": 3, "op": "gloo:all_reduce", "since_ns": 1004},
        "tp": {"enqueued": 7, "completed": 7, "op": None, "since_ns": None},
    }
    assert collective_trace.summarize_flight_recorder({}) == {}


def test_a_rank_answers_even_when_its_torch_has_no_flight_recorder(monkeypatch):
    def missing():
        raise torch_compat.TorchCompatError("_dump_fr_trace_json", "torch's Flight Recorder dump")

    monkeypatch.setattr(torch_compat, "flight_recorder_json", missing)
    msg = decode(collective_trace.collectives_message().rstrip(b"\n"))
    assert msg["t"] == "collectives" and msg["groups"] == {} and "_dump_fr_trace_json" in msg["error"]


def test_a_process_with_no_group_yet_is_at_no_position():
    assert decode(collective_trace.collectives_message().rstrip(b"\n"))["groups"] == {}


def test_a_process_without_torch_answers_without_importing_it():
    """The answer comes from the rank's link thread; a seconds-long `import torch` there would
    overlap the monitor's stack dump signal (faulthandler crashed such a rank, in dump_traceback)."""
    code = ("import sys; from nvrx_core.ft.collective_trace import collectives_message; "
            "print(collectives_message().decode().strip(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert decode(out[0].encode())["groups"] == {} and out[1] == "False"


def test_the_exception_that_ends_a_rank_is_recorded_and_still_printed(tmp_path):
    events_file = str(tmp_path / "events.jsonl")
    script = ("from nvrx_core.events import EventLog\n"
              "from nvrx_core.ft.uncaught import UncaughtExceptionRecorder\n"
              "UncaughtExceptionRecorder(EventLog.from_env()).install()\n"
              "def step():\n    raise ValueError('bad batch 7')\n"
              "step()\n")
    env = dict(os.environ, NVRX_EVENTS_FILE=events_file, RANK="3")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1 and "ValueError: bad batch 7" in result.stderr  # Python's own hook still ran
    [record] = read_events(events_file)
    assert (record["kind"], record["rank"], record["type"], record["message"]) == (
        "worker_exception", 3, "builtins.ValueError", "bad batch 7")
    assert "in step" in record["traceback"] and json.dumps(record)


def test_the_recorder_puts_back_the_hook_it_replaced():
    from nvrx_core.events import EventLog
    from nvrx_core.ft.uncaught import UncaughtExceptionRecorder

    before = sys.excepthook
    recorder = UncaughtExceptionRecorder(EventLog(None))
    recorder.install()
    assert sys.excepthook != before
    recorder.uninstall()
    assert sys.excepthook is before


# ---- the order of evidence and stack dumps (fake clock, no process is signalled) -----------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def watch(rank, pid):
    return RankWatch(rank=rank, local_rank=rank, pid=pid, cycle=0, connected_at=99.0, timeouts=Timeouts(),
                     last_heartbeat=99.5)


def test_a_rank_asked_where_it_is_gets_the_dump_signal_only_after_it_answered_or_could_not():
    """faulthandler walking the link thread while it answers crashed a rank (SIGSEGV in
    dump_traceback): the dump waits for the answer, or for ANSWER_WAIT."""
    clock, dumped, asked = Clock(), [], []
    sched = Scheduler(clock)
    evidence = he.HangEvidence(EventLog(None, source="test"), clock, ask=lambda w: asked.append(w.rank) or True,
                               dump=lambda w: dumped.append(w.rank) or True, read_stacks=lambda w: "",
                               schedule=sched.at, stacks_after=0.5)
    killer = Killer(FTConfig(), EventLog(None, source="test"), sched, clock,
                    send_signal=lambda w, sig: dumped.append((w.rank, sig.name)) or True,
                    report_stacks=lambda w: None, awaiting_evidence=evidence.awaiting_answers)
    # live processes of distinct pids, for process_state(); no signal is sent to any
    hung, peer, silent = watch(0, os.getpid()), watch(1, os.getppid()), watch(2, 1)
    evidence.hang_detected(hung, [hung, peer, silent])
    killer.begin(hung, "heartbeat timeout", overdue=0.0)
    assert sorted(asked) == [0, 1, 2] and dumped == []        # every rank asked, nobody dumped yet
    evidence.answered(peer, {"groups": {}})
    assert dumped == [1]                                      # the peer, once it answered
    clock.now += 0.1
    sched.run_due()
    assert dumped == [1]                                      # the hung rank waits for rank 2's answer
    evidence.answered(hung, {"groups": {}})
    clock.now += 0.1
    sched.run_due()
    assert dumped == [1]
    clock.now = 100.0 + he.ANSWER_WAIT + 0.01                 # rank 2 never answers (it holds the GIL)
    sched.run_due()
    assert dumped[1:] == [2, (0, FTConfig().stack_dump_signal.name)]


def test_the_kill_waits_until_the_dump_file_grew_and_held_still():
    """On a loaded node a rank can take the dump signal and wait for a core before its handler
    writes: a fixed grace then killed it with its stacks unwritten (the report lost the culprit's
    stack). The termination waits for the file to grow and hold still, within DUMP_WAIT_LIMIT."""
    clock, sent, reported, size = Clock(), [], [], {"now": 120}
    cfg = FTConfig()
    killer = Killer(cfg, EventLog(None, source="test"), Scheduler(clock), clock,
                    send_signal=lambda w, sig: sent.append(sig.name) or True,
                    report_stacks=lambda w: reported.append(size["now"]), dump_size=lambda w: size["now"])
    hung = watch(0, os.getpid())
    killer.begin(hung, "heartbeat timeout", overdue=0.0)
    assert sent == [cfg.stack_dump_signal.name]

    def advance(seconds):
        clock.now += seconds
        killer._sched.run_due()

    advance(cfg.stack_dump_grace + 1.0)  # taken, nothing written yet: the old fixed grace killed here
    assert reported == [] and len(sent) == 1
    size["now"] = 4000  # the handler writes
    advance(DUMP_POLL)
    assert reported == []  # still growing, maybe
    advance(DUMP_POLL)
    assert reported == [4000] and sent[1:] == [cfg.rank_termination_signal.name, "SIGCONT"]


def test_a_dump_that_never_comes_delays_the_kill_by_at_most_the_wait_limit():
    clock, sent = Clock(), []
    killer = Killer(FTConfig(), EventLog(None, source="test"), Scheduler(clock), clock,
                    send_signal=lambda w, sig: sent.append(sig.name) or True,
                    report_stacks=lambda w: None, dump_size=lambda w: 0)
    killer.begin(watch(0, os.getpid()), "heartbeat timeout", overdue=0.0)
    while len(sent) == 1:
        clock.now += DUMP_POLL
        killer._sched.run_due()
    assert DUMP_WAIT_LIMIT <= clock.now - 100.0 <= DUMP_WAIT_LIMIT + 2 * DUMP_POLL


def test_a_rank_dumping_to_stderr_is_terminated_after_the_grace():
    clock, sent = Clock(), []
    cfg = FTConfig()
    killer = Killer(cfg, EventLog(None, source="test"), Scheduler(clock), clock,
                    send_signal=lambda w, sig: sent.append(sig.name) or True, report_stacks=lambda w: None)
    killer.begin(watch(0, os.getpid()), "heartbeat timeout", overdue=0.0)
    clock.now += cfg.stack_dump_grace
    killer._sched.run_due()
    assert sent[1:] == [cfg.rank_termination_signal.name, "SIGCONT"]


def test_no_rank_of_the_cycle_is_terminated_while_another_s_dump_is_being_written():
    """A waiting peer's timeout expires a moment after the culprit's; its death makes torch's agent
    stop every worker, so killing it first lost the culprit's stacks (seen in a loaded run). The
    cycle's hung ranks are terminated together once every dump is written."""
    clock, signals, reported = Clock(), [], []
    size = {0: 0, 1: 0}
    cfg = FTConfig()
    killer = Killer(cfg, EventLog(None, source="test"), Scheduler(clock), clock,
                    send_signal=lambda w, sig: signals.append((w.rank, sig.name)) or True,
                    report_stacks=lambda w: reported.append((w.rank, size[w.rank])),
                    dump_size=lambda w: size[w.rank])
    culprit, peer = watch(1, os.getpid()), watch(0, os.getppid())
    killer.begin(culprit, "heartbeat timeout", overdue=0.0)
    killer.begin(peer, "heartbeat timeout", overdue=0.0)
    size[0] = 900  # the peer writes at once; the culprit waits for a core
    terminated = lambda: [r for r, sig in signals if sig == cfg.rank_termination_signal.name]
    for _ in range(20):
        clock.now += DUMP_POLL
        killer._sched.run_due()
    assert terminated() == [] and reported == []
    size[1] = 3000
    for _ in range(3):
        clock.now += DUMP_POLL
        killer._sched.run_due()
        assert sorted(terminated()) in ([], [0, 1])  # together: neither is left for torch's agent to stop
    assert sorted(terminated()) == [0, 1] and sorted(reported) == [(0, 900), (1, 3000)]


def test_a_stopped_rank_s_dump_is_not_waited_for():
    """A SIGSTOPped rank writes nothing until continued: neither it nor its peer waits for its
    dump (the wait limit would add 5 s to every recovery from a stopped rank)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(child.pid) == "stopped", what="the child stopped")
        clock, signals = Clock(), []
        cfg = FTConfig()
        size = {0: 0, 1: 0}
        killer = Killer(cfg, EventLog(None, source="test"), Scheduler(clock), clock,
                        send_signal=lambda w, sig: signals.append((w.rank, sig.name)) or True,
                        report_stacks=lambda w: None, dump_size=lambda w: size[w.rank])
        stopped, peer = watch(1, child.pid), watch(0, os.getpid())
        killer.begin(stopped, "heartbeat timeout", overdue=0.0)
        killer.begin(peer, "heartbeat timeout", overdue=0.0)
        size[0] = 900  # the peer writes its dump at once
        for _ in range(int(cfg.stack_dump_grace / DUMP_POLL) + 3):
            clock.now += DUMP_POLL
            killer._sched.run_due()
        assert clock.now - 100.0 < DUMP_WAIT_LIMIT / 2
        terminated = sorted(r for r, sig in signals if sig == cfg.rank_termination_signal.name)
        assert terminated == [0, 1] and (1, "SIGCONT") in signals, signals
    finally:
        child.kill()
        child.wait()
