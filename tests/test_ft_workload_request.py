"""nvidia-resiliency-ext's workload control requests under ft_launcher: a rank asks, then fails,
and the launcher does what was asked instead of restarting (ShutdownWorkload: exit 24, the job
ends; ExcludeThisNode: exit 25, this node leaves); a request it cannot take is refused by name."""

import os

import pytest

from harness.launcher import SCRIPTS, kinds, run_launcher
from nvrx_core.events import read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.ft import WorkloadAction, WorkloadControlRequest
from nvrx_core.ft.protocol import ProtocolError, decode, encode

JOB = os.path.join(SCRIPTS, "workload_request_job.py")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("action, code", [("ShutdownWorkload", ExitCode.WORKLOAD_SHUTDOWN),
                                          ("ExcludeThisNode", ExitCode.NODE_EXCLUDED)])
def test_a_request_then_a_failure_ends_the_job_without_a_restart(tmp_path, action, code):
    events_file = str(tmp_path / "events.jsonl")
    result = run_launcher(["--nproc-per-node", "2", "--max-restarts", "3", "--events-file", events_file,
                           "--ft-initial-rank-heartbeat-timeout", "120", JOB, action], timeout=200)
    assert result.returncode == code, result.stdout[-4000:]
    events = read_events(events_file)
    [request] = kinds(events, "workload_request")
    assert (request["rank"], request["action"], request["reason"]) == (1, action, "bad data shard")
    assert kinds(events, "workers_failed") and not kinds(events, "restart_begun")
    assert kinds(events, "launcher_exit")[-1]["exit_code"] == code


def test_continue_sends_nothing_and_a_request_outside_ft_launcher_is_refused():
    from nvrx_core.ft import RankMonitorClient, RankMonitorClientError

    client = RankMonitorClient()  # never connected
    client.send_workload_control_request(WorkloadControlRequest(WorkloadAction.Continue))
    with pytest.raises(RankMonitorClientError, match="not connected"):
        client.send_workload_control_request(WorkloadControlRequest(WorkloadAction.ShutdownWorkload))


def test_the_message_carries_a_name_and_the_monitor_checks_it():
    assert decode(encode("wc", action="ShutdownWorkload")[:-1])["action"] == "ShutdownWorkload"
    with pytest.raises(ProtocolError, match="action"):
        decode(encode("wc", action=2)[:-1])
