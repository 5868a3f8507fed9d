"""Preemption under ft_launcher: SIGTERM delivered to one worker of a real 2-rank job.

The worker's preemption handler (its SIGTERM claimed from the signal registry) records the
signal, both ranks agree at the next check and exit with ExitCode.PREEMPTED, and the
launcher stops with that code instead of restarting. Warm-started workers are forked from
a server whose dispositions they must not inherit; cold ones are fresh interpreters:
both are checked.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from harness.launcher import SCRIPTS, kinds, preempt_progress
from nvrx_core.events import read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.report import attribution
from nvrx_core.report.incidents import find_incidents
from harness import wait_for

JOB = os.path.join(SCRIPTS, "preempt_job.py")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("start", [[], ["--no-warm-start"]], ids=["warm", "cold"])
def test_sigterm_to_one_worker_stops_the_job_with_exit_code_preempted(tmp_path, start):
    out, events_file = str(tmp_path), str(tmp_path / "events.jsonl")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("NVRX_EVENTS_FILE", None)
    env.pop("FAULT_TOL_FINISHED_FLAG_FILE", None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "nvrx_core.ft.command", "--nproc-per-node", "2", "--max-restarts", "2",
         "--events-file", events_file, *start, JOB, "--out", out],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        wait_for(lambda: all((preempt_progress(out, r) or {}).get("step", -1) >= 4 for r in (0, 1)), timeout=150,
                 what="both workers training")
        os.kill(preempt_progress(out, 1)["pid"], signal.SIGTERM)  # only rank 1 is told, as when one node drains first
        output, _ = launcher.communicate(timeout=150)
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)  # the launcher, its monitor, any worker left
        except ProcessLookupError:
            pass
        if launcher.poll() is None:
            launcher.communicate()
    assert launcher.returncode == ExitCode.PREEMPTED, output[-4000:]
    reports = [json.load(open(os.path.join(out, f"report.rank{r}.json"))) for r in (0, 1)]
    assert reports[0]["stopped_at"] == reports[1]["stopped_at"] and reports[0]["stopped_at"] % 2 == 0
    assert [r["signals"] for r in reports] == [[], ["SIGTERM"]]  # rank 0 learnt it from the collective
    assert [r["sigterm_owner"] for r in reports] == ["preemption", "preemption"]
    assert [r["cycle"] for r in reports] == [0, 0]
    events = read_events(events_file)
    assert not kinds(events, "restart_begun")  # preempted: requeue the job, do not restart in place
    assert {e["rank"] for e in kinds(events, "preemption_agreed")} == {0, 1}
    codes = {c for e in kinds(events, "workers_failed") for c in e["exit_codes"].values()}
    # The first rank to exit 18 ends the cycle; the agent then stops the other with SIGTERM,
    # which may land while it is itself exiting with 18 (both reports above are written).
    assert ExitCode.PREEMPTED in codes and codes <= {ExitCode.PREEMPTED, -signal.SIGTERM}, codes
    [incident] = find_incidents(events)  # `nvrx report`: preempted, no rank to blame
    assert (incident.verdict.kind, incident.verdict.culprits) == (attribution.PREEMPTED, [])
    assert "SIGTERM" in incident.verdict.evidence[0]
