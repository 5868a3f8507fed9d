"""Parts that each claim signals, used together in one rank under ft_launcher: the ft client
(stack dump on SIGUSR2), the in-process Wrapper (interrupt on SIGUSR1, hard-timeout dump),
the preemption handler (SIGTERM) and the async checkpointer, through an in-process restart.
Real launcher, real node monitor, real gloo ranks (tests/scripts/combined_job.py)."""

import json
import os

import pytest

from harness.launcher import SCRIPTS, kinds, run_launcher
from nvrx_core.events import read_events

pytestmark = pytest.mark.timeout(240)

JOB = os.path.join(SCRIPTS, "combined_job.py")


def test_client_wrapper_preemption_and_checkpointer_work_together_and_give_their_signals_back(tmp_path):
    out, events_file = tmp_path / "out", tmp_path / "events.jsonl"
    out.mkdir()
    result = run_launcher(["--nproc-per-node", "2", "--max-restarts", "0", "--events-file", str(events_file),
                           "--ft-rank-heartbeat-timeout", "30", JOB, str(out)])
    assert result.returncode == 0, result.stdout[-4000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        # restarted in-process once, from the step-5 checkpoint, to the same weights on both ranks
        assert report["iterations"] == [{"iteration": 0, "resumed_at": 0}, {"iteration": 1, "resumed_at": 5}]
        inside = report["owners_inside"]
        assert inside["SIGUSR1"] == ["inprocess.interrupt"]
        assert inside["SIGTERM"] == ["preemption"]
        assert inside["SIGUSR2"] == ["ft.client"]  # the node monitor's dump file, not displaced by the Wrapper
        assert "preemption cannot claim SIGUSR1" in report["conflict"]
        assert "inprocess.interrupt" in report["conflict"]
        assert report["owners_after_wrapper"] == {"SIGUSR2": ["ft.client"]}
        assert report["owners_at_end"] == {}
    assert reports[0]["checksum"] == reports[1]["checksum"]
    events = read_events(str(events_file))
    assert all(e.get("fault") != "hang" for e in kinds(events, "fault_detected"))  # the client kept it alive
    assert not kinds(events, "restart_begun")  # no process restart: the Wrapper handled it in-process
