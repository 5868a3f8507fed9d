"""ft_launcher end to end: real launcher, real node monitor, real gloo ranks (2 per job)."""

import os
import signal

import pytest

from harness.launcher import SCRIPTS, kinds, run_launcher
from nvrx_core.events import read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.ft import launcher
from nvrx_core.ft.agent import stopped_by_the_poll
from nvrx_core.report import attribution
from nvrx_core.report.incidents import find_incidents

pytestmark = pytest.mark.timeout(240)

TRAIN = ["-m", "nvrx_core.demo.train"]
FAIL_JOB = os.path.join(SCRIPTS, "fail_job.py")


def train_args(tmp_path, name, *extra, steps=30, step_time=0.02):
    run = tmp_path / name
    return [
        "--nproc-per-node", "2", "--max-restarts", "3", "--events-file", str(run / "events.jsonl"),
    ], [
        *TRAIN, "--steps", str(steps), "--step-time", str(step_time), "--ckpt-dir", str(run / "ckpt"),
        "--hash-file", str(run / "weights.sha"), *extra,
    ], run


def launch_train(tmp_path, name, ft_flags=(), job_flags=(), **kw):
    launcher_flags, job, run = train_args(tmp_path, name, *job_flags, **kw)
    result = run_launcher([*launcher_flags, *ft_flags, *job])
    events = read_events(str(run / "events.jsonl"))
    digest = (run / "weights.sha").read_text().strip() if (run / "weights.sha").exists() else None
    return result, events, digest


@pytest.fixture(scope="module")
def reference_hash(tmp_path_factory):
    result, _, digest = launch_train(tmp_path_factory.mktemp("ref"), "ref")
    assert result.returncode == 0, result.stdout[-3000:]
    assert digest
    return digest


@pytest.mark.parametrize("start", [[], ["--no-warm-start"]], ids=["warm", "cold"])
def test_crash_restarts_and_resumes_from_checkpoint(tmp_path, reference_hash, start):
    result, events, digest = launch_train(tmp_path, "crash", ft_flags=start, job_flags=["--fault", "rank_killed:1:15"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert len(kinds(events, "restart_begun")) == 1
    resumed = [e["step"] for e in kinds(events, "training_resumed") if e["cycle"] == 1]
    assert resumed and set(resumed) == {10}  # the last checkpoint before the crash at step 15
    assert digest == reference_hash  # nothing lost, nothing changed
    [incident] = find_incidents(events)
    assert (incident.verdict.kind, incident.verdict.culprits) == (attribution.KILLED, [1]), incident.verdict
    assert 0 not in incident.verdict.culprits and incident.resumed_after is not None
    assert incident.last_step >= 14 and incident.resumed_from == 10


def test_exception_restarts(tmp_path, reference_hash):
    result, events, digest = launch_train(tmp_path, "exc", job_flags=["--fault", "rank_exception:0:12"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert digest == reference_hash
    # Rank 1 fails too, in gloo, once rank 0's exception resets its connection, and which of
    # the two the launcher's poll records is a race: loaded soak runs saw {0: 1}, and {1: 1}
    # with rank 0 stopped. Whoever is recorded exited 1 (not a signal); the report, which
    # reads the exceptions, names rank 0.
    [failed] = kinds(events, "workers_failed")
    assert failed["exit_codes"] and set(failed["exit_codes"].values()) == {1}, failed
    [incident] = find_incidents(events)
    assert (incident.verdict.kind, incident.verdict.culprits) == (attribution.EXCEPTION, [0]), incident.verdict


def test_hang_detected_in_heartbeat_mode_with_stack_dump(tmp_path, reference_hash):
    result, events, digest = launch_train(
        tmp_path, "hang", ft_flags=["--ft-rank-heartbeat-timeout", "2", "--ft-initial-rank-heartbeat-timeout", "60"],
        job_flags=["--fault", "rank_hung:1:12"])
    assert result.returncode == 0, result.stdout[-3000:]
    detected = kinds(events, "fault_detected")
    assert detected and all(e["reason"] == "heartbeat timeout" for e in detected)
    hung_rank = [e for e in detected if e["rank"] == 1]
    assert hung_rank, detected
    assert any(e["rank"] == 1 for e in kinds(events, "stacks_dumped"))
    assert any(e["rank"] == 1 and e["signal"] == "SIGKILL" for e in kinds(events, "rank_killed"))
    # The hung rank's stacks, dumped by faulthandler into its own file, are printed by the monitor
    # as one block (both ranks hang and are dumped at the same moment: no interleaving).
    header = "stacks of hung rank 1 "
    assert header in result.stdout, result.stdout[-6000:]
    block = result.stdout.split(header, 1)[1].split("[nvrx monitor", 1)[0]
    assert "(most recent call first)" in block and 'line' in block and "in maybe_inject" in block, block
    [incident] = find_incidents(events)  # rank 1 stopped; rank 0 only waited for it in a collective
    assert (incident.verdict.kind, incident.verdict.culprits, incident.verdict.waiting) == (attribution.HANG, [1], [0])
    injected = kinds(events, "fault_injected")[0]["time"]
    assert 1.5 < hung_rank[0]["time"] - injected < 2 + 10  # the 2 s timeout, not gloo's 30 min
    assert digest == reference_hash


def test_hang_detected_in_section_mode(tmp_path):
    result, events, _ = launch_train(
        tmp_path, "sections",
        ft_flags=["--ft-rank-section-timeouts", "setup:120,step:2,checkpointing:30",
                  "--ft-initial-rank-heartbeat-timeout", "None", "--ft-rank-heartbeat-timeout", "None"],
        job_flags=["--mode", "sections", "--fault", "rank_hung:0:8"])
    assert result.returncode == 0, result.stdout[-3000:]
    reasons = {e["reason"] for e in kinds(events, "fault_detected")}
    assert reasons == {"section 'step' timeout"}, reasons


def test_calculated_timeouts_persist_and_apply_in_next_cycle(tmp_path):
    # Cycle 0 learns timeouts at step 5 (saved with the step-10 checkpoint), then crashes.
    # Cycle 1 loads them: a hang is caught after ~safety_factor x step time, not the 300 s configured.
    result, events, _ = launch_train(
        tmp_path, "calc",
        ft_flags=["--ft-rank-heartbeat-timeout", "300", "--ft-safety-factor", "80"],
        job_flags=["--calc-timeouts-at", "5", "--fault", "rank_killed:1:13", "--fault", "rank_hung:0:16:1"],
        step_time=0.05)
    assert result.returncode == 0, result.stdout[-3000:]
    state = (tmp_path / "calc" / "ckpt" / "ft_state.json").read_text()
    assert '"heartbeat"' in state
    updates = [e for e in kinds(events, "timeouts_updated") if e["cycle"] == 1]
    assert updates, "cycle 1 did not push the saved timeouts to the monitor"
    learned = updates[0]["timeouts"]["heartbeat"]
    assert 80 * 0.04 < learned < 150, learned  # learned from ~50 ms steps; far below the 300 s configured
    detected = [e for e in kinds(events, "fault_detected") if e["cycle"] == 1]
    injected = [e for e in kinds(events, "fault_injected") if e["cycle"] == 1][0]
    assert detected and detected[0]["time"] - injected["time"] < learned + 10


def test_restarts_exhausted_exit_code(tmp_path):
    marker = tmp_path / "starts"
    result = run_launcher(["--nproc-per-node", "2", "--max-restarts", "2", "--max-no-progress-restarts", "0",
                           FAIL_JOB, "--exit-code", "3", "--marker", str(marker)])
    assert result.returncode == ExitCode.RESTARTS_EXHAUSTED, result.stdout[-3000:]
    cycles = {line.split(":")[1] for line in marker.read_text().splitlines()}
    assert cycles == {"0", "1", "2"}  # 1 start + 2 restarts


def test_no_progress_limit_stops_the_restart_loop(tmp_path):
    marker, events_file = tmp_path / "starts", tmp_path / "events.jsonl"
    result = run_launcher(["--nproc-per-node", "2", "--max-restarts", "10", "--max-no-progress-restarts", "2",
                           "--events-file", str(events_file),
                           FAIL_JOB, "--progress-to", "3", "--marker", str(marker)])
    assert result.returncode == ExitCode.NO_PROGRESS, result.stdout[-3000:]
    # cycle 0 progressed (to iteration 3); cycles 1 and 2 got no further: stop after cycle 2.
    cycles = {line.split(":")[1] for line in marker.read_text().splitlines()}
    assert cycles == {"0", "1", "2"}
    exit_event = kinds(read_events(str(events_file)), "launcher_exit")[0]
    assert exit_event["exit_code"] == ExitCode.NO_PROGRESS


def test_terminal_worker_exit_code_is_not_restarted(tmp_path):
    marker = tmp_path / "starts"
    result = run_launcher(["--nproc-per-node", "2", "--max-restarts", "3",
                           FAIL_JOB, "--exit-code", str(int(ExitCode.PREEMPTED)), "--fail-rank", "1",
                           "--marker", str(marker)])
    assert result.returncode == ExitCode.PREEMPTED, result.stdout[-3000:]
    cycles = {line.split(":")[1] for line in marker.read_text().splitlines()}
    assert cycles == {"0"}  # one cycle only


@pytest.mark.parametrize("start", [[], ["--no-warm-start"]], ids=["warm", "cold"])
def test_a_rank_the_launcher_stopped_after_a_peer_failed_is_recorded_as_stopped_not_blamed(tmp_path, start):
    """Rank 1 exits 1; rank 0 sleeps until torch's poll terminates it. That SIGTERM is the
    launcher's, so the failure record names rank 0 stopped and the report does not blame it."""
    events_file = tmp_path / "events.jsonl"
    result = run_launcher(["--nproc-per-node", "2", "--max-restarts", "0", "--events-file", str(events_file),
                           *start, FAIL_JOB, "--exit-code", "1", "--fail-rank", "1"])
    assert result.returncode != 0, result.stdout[-3000:]
    events = read_events(str(events_file))
    [failed] = kinds(events, "workers_failed")
    assert failed["exit_codes"]["1"] == 1
    assert failed["stopped_ranks"] == [0]
    [incident] = find_incidents(events)
    assert (incident.verdict.kind, incident.verdict.culprits) == (attribution.EXITED, [1]), incident.verdict


def test_ranks_stopped_by_the_poll_are_the_ones_still_running_when_it_began():
    sigterm, sigkill = -signal.SIGTERM, -signal.SIGKILL
    assert stopped_by_the_poll({1: sigkill, 0: sigterm}, running_before={0}) == [0]  # cold start
    assert stopped_by_the_poll({1: 1}, running_before={0, 2}) == [0, 2]  # warm start: not listed
    assert stopped_by_the_poll({1: 1, 0: sigkill, 2: sigterm}, running_before={0, 1, 2}) == [0, 2]
    # an outside SIGTERM that ended the rank before the poll is the fault, not the stop
    assert stopped_by_the_poll({1: sigterm, 0: sigterm}, running_before={0}) == [0]
    # every failed rank looks stopped (one died as the poll began): none can be told apart
    assert stopped_by_the_poll({1: sigkill, 0: sigterm}, running_before={0, 1}) == []
    assert stopped_by_the_poll({0: 1}, running_before=set()) == []


def test_finished_flag_honoured_and_written(tmp_path):
    flag = tmp_path / "finished.flag"
    launcher_flags, job, run = train_args(tmp_path, "fin", steps=5, step_time=0.0)
    result = run_launcher([*launcher_flags, *job], env={"FAULT_TOL_FINISHED_FLAG_FILE": str(flag)})
    assert result.returncode == 0, result.stdout[-3000:]
    assert flag.exists()  # the completed job wrote it
    marker = tmp_path / "starts"
    again = run_launcher(["--nproc-per-node", "2", FAIL_JOB, "--marker", str(marker)],
                         env={"FAULT_TOL_FINISHED_FLAG_FILE": str(flag)})
    assert again.returncode == 0
    assert not marker.exists()  # no worker started


@pytest.mark.parametrize("flags, expected", [
    (["--ft-rank-heartbeat-timeout", "-5"], "rank_heartbeat_timeout"),
    (["--ft-safety-factor", "0.5"], "safety_factor"),
    (["--ft-rank-section-timeouts", "setup600"], "rank_section_timeouts"),
    (["--ft-rank-termination-signal", "SIGNOPE"], "rank_termination_signal"),
    (["--ft-cfg-path", "/nonexistent/ft.yaml"], "does not exist"),
    (["--ft-restart-policy", "min-healthy"], "any-failed"),
    (["--workers-stop-timeout", "0"], "workers-stop-timeout"),
    (["--warm-start-preload", "no_such_module_xyz"], "no_such_module_xyz"),
    (["--nnodes", "3:2"], "need 0 < min <= max"),
    (["--ft-use-infra-group-rank", "--ft-rdzv-impl", "legacy", "--rdzv-backend", "c10d"],
     "needs the barrier rendezvous"),
    (["--rdzv-conf", "node_timeout=0.1,heartbeat_interval=1"], "node_timeout"),
    (["--rdzv-conf", "join_timeout=soon"], "join_timeout"),
    (["BADYAML"], "not valid YAML"),
    (["BADFIELD"], "unknown field 'rank_heartbeat_timout'"),
])
def test_bad_config_fails_before_any_worker_starts(tmp_path, capsys, monkeypatch, flags, expected):
    monkeypatch.delenv("FAULT_TOL_FINISHED_FLAG_FILE", raising=False)
    if flags == ["BADYAML"]:
        (tmp_path / "bad.yaml").write_text("fault_tolerance:\n  rank_heartbeat_timeout: [1,\n")
        flags = ["--ft-cfg-path", str(tmp_path / "bad.yaml")]
    elif flags == ["BADFIELD"]:
        (tmp_path / "typo.yaml").write_text("fault_tolerance:\n  rank_heartbeat_timout: 10\n")
        flags = ["--ft-cfg-path", str(tmp_path / "typo.yaml")]
    # The launcher's own main, in this process: a bad value must end it before anything starts
    # (test_a_bad_config_ends_the_command_before_any_worker_starts runs the whole command once).
    marker = tmp_path / "starts"
    code = launcher.main(["--nproc-per-node", "2", *flags, FAIL_JOB, "--exit-code", "0", "--marker", str(marker)])
    assert code == ExitCode.CONFIG_ERROR
    assert expected in capsys.readouterr().err
    assert not marker.exists()


def test_a_bad_config_ends_the_command_before_any_worker_starts(tmp_path):
    (tmp_path / "typo.yaml").write_text("fault_tolerance:\n  rank_heartbeat_timout: 10\n")
    marker = tmp_path / "starts"
    result = run_launcher(["--nproc-per-node", "2", "--ft-cfg-path", str(tmp_path / "typo.yaml"),
                           FAIL_JOB, "--exit-code", "0", "--marker", str(marker)])
    assert result.returncode == ExitCode.CONFIG_ERROR, result.stdout[-3000:]
    assert "unknown field 'rank_heartbeat_timout'" in result.stdout
    assert not marker.exists()


def test_missing_training_script_is_a_config_error(tmp_path, capsys):
    assert launcher.main(["--nproc-per-node", "2", str(tmp_path / "nope.py")]) == ExitCode.CONFIG_ERROR
    assert "nope.py' does not exist" in capsys.readouterr().err


def test_plain_ddp_example_runs_under_ft_launcher(tmp_path):
    example = os.path.join(os.path.dirname(SCRIPTS), "..", "examples", "plain_ddp_ft.py")
    result = run_launcher(["--nproc-per-node", "2", "--ft-rank-section-timeouts", "setup:600,step:60,checkpointing:300",
                           example, "--ckpt-dir", str(tmp_path), "--steps", "60"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert (tmp_path / "model.pt").exists() and (tmp_path / "ft_state.json").exists()
    learned = (tmp_path / "ft_state.json").read_text()
    assert '"step": null' not in learned  # the step section's timeout was learned


def test_health_checks_run_before_every_start_and_stop_a_sick_node(tmp_path):
    events_file, marker = tmp_path / "events.jsonl", tmp_path / "starts"
    env = {"PYTHONPATH": SCRIPTS, "HEALTH_MARKER": str(tmp_path / "health.marker")}
    result = run_launcher(["--nproc-per-node", "2", "--max-restarts", "3", "--events-file", str(events_file),
                           "--health-check", "health_hooks:healthy", "--health-check", "health_hooks:sick_after_first_start",
                           FAIL_JOB, "--exit-code", "1", "--marker", str(marker)], env=env)
    assert result.returncode == ExitCode.FAILURE, result.stdout[-3000:]
    checks = kinds(read_events(str(events_file)), "health_check")
    assert [(c["check"], c["healthy"]) for c in checks] == [
        ("healthy", True), ("sick_after_first_start", True),  # before the first start
        ("healthy", True), ("sick_after_first_start", False),  # before the restart: stop, do not start
    ]
    assert "GPU 3 fell off the bus" in result.stdout
    assert {line.split(":")[1] for line in marker.read_text().splitlines()} == {"0"}


def test_two_nodes_restart_together_over_c10d_rendezvous(tmp_path, reference_hash):
    """Two launchers (one rank each) stand in for two nodes: a crash on one restarts both."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = {}

    def node(n):
        results[n] = run_launcher([
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "--max-restarts", "2",
            "--events-file", str(tmp_path / f"events{n}.jsonl"), *TRAIN, "--steps", "30", "--step-time", "0.02",
            "--ckpt-dir", str(tmp_path / "ckpt"), "--hash-file", str(tmp_path / "weights.sha"),
            "--fault", "rank_killed:1:15"])

    threads = [threading.Thread(target=node, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[n].returncode for n in (0, 1)] == [0, 0], results[0].stdout[-2000:] + results[1].stdout[-2000:]
    for n in (0, 1):
        assert len(kinds(read_events(str(tmp_path / f"events{n}.jsonl")), "restart_begun")) == 1
    assert (tmp_path / "weights.sha").read_text().strip() == reference_hash


def test_time_based_hang_freezes_the_process_and_is_recovered(tmp_path):
    # rank_hung from a thread stops the whole process (SIGSTOP); the monitor still kills it.
    # 200 steps of 20 ms: the fault (1 s after start) lands in training, not after it.
    result, events, digest = launch_train(
        tmp_path, "frozen", ft_flags=["--ft-rank-heartbeat-timeout", "2", "--ft-initial-rank-heartbeat-timeout", "15"],
        job_flags=["--fault-after", "rank_hung:1:1.0"], steps=200)
    assert result.returncode == 0, result.stdout[-3000:]
    assert any(e["rank"] == 1 for e in kinds(events, "fault_detected"))
    assert digest is not None
