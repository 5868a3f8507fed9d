"""nvrx report on a real run: one fault kind per restart cycle of a 2-rank job under ft_launcher
(gloo on CPU, heartbeat timeouts), and the report must name each culprit and kind and never
blame the rank that only waited. Preemption, a straggler stop and a lost node are checked on
the runs of their own tests (test_preemption_ft_launcher, test_straggler_dist, test_multinode)."""

import pytest

from harness.launcher import run_launcher
from nvrx_core.cli import main as nvrx
from nvrx_core.report import attribution as a
from nvrx_core.report.build import build_report

FAULTS = [  # (flag, spec, expected kind, culprits, waiting); each cycle gets 10 steps further
    ("--fault", "rank_killed:1:15:0", a.KILLED, [1], None),
    ("--fault", "rank_exception:0:25:1", a.EXCEPTION, [0], None),
    ("--fault", "rank_hung:1:35:2", a.HANG, [1], [0]),
    ("--fault", "rank_hung_gil:0:45:3", a.HANG_GIL, [0], [1]),
    ("--fault-after", "rank_hung:1:1.5:4", a.STOPPED, [1], [0]),  # from a thread: SIGSTOP to itself
]


@pytest.mark.timeout(400)
def test_each_fault_kind_gets_its_culprit_and_waiting_peers_are_not_blamed(tmp_path, capsys):
    events_file = tmp_path / "events.jsonl"
    job = ["-m", "nvrx_core.demo.train", "--steps", "90", "--step-time", "0.05", "--ckpt-dir", str(tmp_path / "ckpt")]
    for flag, spec, *_ in FAULTS:
        job += [flag, spec]
    result = run_launcher(["--nproc-per-node", "2", "--max-restarts", str(len(FAULTS) + 1),
                           "--events-file", str(events_file), "--ft-rank-heartbeat-timeout", "2",
                           "--ft-initial-rank-heartbeat-timeout", "60", *job], timeout=360)
    assert result.returncode == 0, result.stdout[-4000:]
    report = build_report(str(events_file))
    launchers = {e.get("launcher") for e in report.loaded.events}  # launcher, monitor, ranks: one tree
    assert len(launchers) == 1 and None not in launchers, launchers
    assert {e["source"] for e in report.loaded.events if e.get("source")} >= {"launcher", "monitor"}
    got = [(i.cycle, i.verdict.kind, i.verdict.culprits) for i in report.incidents]
    assert got == [(c, kind, culprits) for c, (_, _, kind, culprits, _) in enumerate(FAULTS)], report.text()
    for incident, (*_, waiting) in zip(report.incidents, FAULTS):
        if waiting is not None:  # the peer's side of a hang: it answered from inside the collective
            assert incident.verdict.waiting == waiting, report.text()
        assert incident.injected is not None and incident.injected["rank"] == incident.verdict.culprits[0]
        assert incident.detected_time >= incident.fault_time and incident.first_step_time is not None
        assert incident.resumed_from >= 10 * (incident.cycle + 1) and incident.steps_redone is not None
    hang = report.incidents[2]
    assert 1.5 < hang.detect_s < 6.0, report.text()  # the 2 s heartbeat timeout, from the last heartbeat
    assert any("maybe_inject" in line for line in hang.verdict.evidence), hang.verdict.evidence  # its stack
    g = report.goodput
    assert g.steps_kept == 90 and g.steps_redone > 0 and 0.0 < g.ettr < 1.0
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    assert nvrx(["report", str(events_file)]) == 0
    out = capsys.readouterr().out
    assert "cycle 3: hang (GIL held): culprit rank 0; waiting: rank 1" in out, out
