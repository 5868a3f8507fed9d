"""Real Slurm jobs from NeMo-Run: `SlurmExecutor` + `LocalTunnel` on the local cluster of
tools/local_slurm.sh (three `slurmd -N` nodes on this host), 2 nodes x 2 ranks, with
`FaultTolerancePlugin()` and `PreemptionPlugin()`, as a user submits them (`detach=True`).

Every case ends with the weights of the fault-free job. Slurm's own record says whether the
job was requeued (`Restarts`), and NeMo-Run's job-results file whether an attempt counted
as failed. The cases run one after another in one file: NeMo-Run's rendezvous port is
fixed (29500) and every "node" is this host, and a downed node is the cluster's.
"""

import json
import os
import sys

import pytest

nemo_run = pytest.importorskip("nemo_run")
run = nemo_run

from harness.launcher import REPO, kinds  # noqa: E402
from nvrx_core.events import read_events  # noqa: E402
from nvrx_core.report.build import build_report  # noqa: E402
from nvrx_nemo_run import FaultTolerancePlugin, PreemptionPlugin  # noqa: E402
from slurm_cluster import (cluster_env, crash_node, exclusive, nodes_back, reference_weights, slurm,  # noqa: E402
                           wait_for_job)

pytestmark = pytest.mark.timeout(900)

MEGATRON_DIR = os.path.join(REPO, "examples", "megatron_style")
TRAINER = os.path.join(MEGATRON_DIR, "pretrain_gpt.py")
ITERS = 120
STEP_TIME = 0.04
# The ranks heartbeat every step: 10 s catches a hang in a test and never a loaded step.
FT = dict(initial_rank_heartbeat_timeout=120, rank_heartbeat_timeout=10)


@pytest.fixture(scope="module", autouse=True)
def slurm_env(tmp_path_factory):
    env = cluster_env()
    with exclusive():
        yield from _nemo_run_can_submit(tmp_path_factory, env)


def _nemo_run_can_submit(tmp_path_factory, env):
    # nemo_run packages through invoke, which mirrors stdin: pytest's captured stdin refuses reads
    stdin = open(tmp_path_factory.mktemp("stdin") / "stdin", "w+")
    saved = {k: os.environ.get(k) for k in env}, sys.stdin
    os.environ.update(env)
    sys.stdin = stdin
    yield env
    sys.stdin = saved[1]
    stdin.close()
    for key, value in saved[0].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class Job:
    """One submitted NeMo-Run Slurm job and what it left behind."""

    def __init__(self, root, task, plugins, time_limit="00:10:00"):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),  # our ft_launcher
               "OMP_NUM_THREADS": "1", "NVRX_EVENTS_FILE": str(root / "events.jsonl"), "PYTHONPATH": MEGATRON_DIR}
        executor = run.SlurmExecutor(account="nvrx", partition="debug", nodes=2, ntasks_per_node=2, time=time_limit,
                                     tunnel=run.LocalTunnel(job_dir=str(root / "exp" / "experiments")),
                                     env_vars=env, packager=run.Packager())
        with run.Experiment("nvrx", executor=executor, base_dir=str(root / "exp"), log_level="WARN") as exp:
            exp.add(task, name="job", plugins=plugins)
            exp.run(detach=True)
        self.job = exp.jobs[0]
        self.job_id = self.job.handle.rsplit("/", 1)[-1]
        self.job_dir = self.job.executor.job_dir

    def wait(self, **kwargs):
        self.record = wait_for_job(self.job_id, **kwargs)
        return self.record

    def results(self):
        folder = self.root / "results"
        return [json.loads((folder / f"result{r}.json").read_text()) for r in range(4)
                if (folder / f"result{r}.json").exists()]

    def attempts(self):
        """NeMo-Run's job-results file: one 'JOB RESTART S|F|X' line per attempt."""
        with open(os.path.join(self.job_dir, "job_job_results")) as f:
            return [line.split()[2] for line in f if line.strip()]

    def finished(self):
        return os.path.exists(os.path.join(self.job_dir, "job_finished_flag"))

    def events(self):
        return read_events(str(self.root / "events.jsonl"))

    def log(self):
        names = sorted(n for n in os.listdir(self.job_dir) if n.endswith(".out"))
        return "\n".join(open(os.path.join(self.job_dir, n)).read()[-3000:] for n in names)


def script(root, iters=ITERS, step_time=STEP_TIME, fault=None):
    args = ["--save", str(root / "ckpt"), "--train-iters", str(iters), "--step-time", str(step_time),
            "--result-dir", str(root / "results")]
    return run.Script(path=TRAINER, entrypoint="python", args=[*args, *(["--simulated-fault", fault] if fault else [])])


def partial(root, iters=ITERS, step_time=STEP_TIME, fault=None):
    sys.path.insert(0, MEGATRON_DIR)
    try:
        import bridge_style
        import pretrain_gpt
        from nvrx_megatron import FaultToleranceConfig
    finally:
        sys.path.remove(MEGATRON_DIR)
    ft = run.Config(FaultToleranceConfig)
    if fault:
        kind, rank, delay = fault.split(":")
        ft = run.Config(FaultToleranceConfig, simulate_fault=True, simulated_fault_type=kind,
                        simulated_fault_rank=int(rank), simulated_fault_base_delay=int(delay))
    cfg = run.Config(bridge_style.ConfigContainer, train=run.Config(bridge_style.TrainConfig, train_iters=iters),
                     checkpoint=run.Config(bridge_style.CheckpointConfig, save=str(root / "ckpt")), ft=ft)
    return run.Partial(pretrain_gpt.pretrain_tiny_gpt, cfg=cfg, step_time=step_time,
                       result_dir=str(root / "results"))


def plugins(**ft):
    return [FaultTolerancePlugin(**{**FT, **ft}), PreemptionPlugin()]


def assert_finished_like_the_reference(job, weights, iters=ITERS):
    assert job.record.state == "COMPLETED", (job.record, job.log())
    results = job.results()
    assert [r["iteration"] for r in results] == [iters] * 4, (results, job.log())
    assert all(r["weights"] == weights for r in results), job.log()
    assert job.finished()


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A fault-free run's weights: what every job must end with."""
    return reference_weights(str(tmp_path_factory.getbasetemp().parent), ITERS)


def test_a_fault_free_job_finishes_without_a_requeue(tmp_path, weights):
    """A Partial; a Script's job is the killed-rank case below, which ends the same way."""
    job = Job(tmp_path, partial(tmp_path), plugins())
    job.wait(timeout=300)
    assert_finished_like_the_reference(job, weights)
    assert job.record.restarts == 0 and job.attempts() == ["S"]
    assert not kinds(job.events(), "restart_begun")
    assert [e["exit_code"] for e in kinds(job.events(), "launcher_exit")] == [0, 0]   # both nodes


@pytest.mark.parametrize("make_task, fault", [(script, "rank_killed:1:3"), (partial, "rank_hung:2:3")],
                         ids=["killed_rank_script", "hung_rank_partial"])
def test_a_failed_rank_restarts_in_the_job_without_a_requeue(tmp_path, weights, make_task, fault):
    job = Job(tmp_path, make_task(tmp_path, fault=fault), plugins())
    job.wait(timeout=400)
    assert_finished_like_the_reference(job, weights)
    assert job.record.restarts == 0 and job.attempts() == ["S"]
    events = job.events()
    assert [e["fault"] for e in kinds(events, "fault_injected")] == [fault.split(":")[0]]
    assert len({e["cycle"] for e in kinds(events, "restart_begun")}) == 1     # one in-job restart, on both nodes
    if "hung" in fault:
        assert kinds(events, "fault_detected"), "the monitor did not report the hang"


def test_a_crashed_node_requeues_the_job_which_finishes_on_the_healthy_nodes(tmp_path, weights):
    # slow steps (weights do not depend on the pace): the node goes down mid-run
    job = Job(tmp_path, partial(tmp_path, step_time=0.08), plugins())
    downed = []

    def down_the_second_node_once_training(record):
        if downed or not (tmp_path / "ckpt" / "checkpoint.pt").exists():
            return
        downed.append(_expand(record.nodes)[-1])
        assert crash_node(downed[0]), "no process of the job was found on that node"

    try:
        job.wait(timeout=600, while_running=down_the_second_node_once_training)
    finally:
        nodes_back()
    assert downed and job.record.restarts >= 1, job.record
    assert downed[0] not in _expand(job.record.nodes)                  # it finished elsewhere
    assert_finished_like_the_reference(job, weights)


def _expand(nodelist):
    return slurm("scontrol", "show", "hostnames", nodelist).split()


def test_retries_exhausted_stop_the_job_without_an_endless_requeue(tmp_path):
    # the fault fires in every attempt's first cycle, and no in-job restart is allowed
    job = Job(tmp_path, script(tmp_path, fault="rank_killed:1:2"), plugins(num_in_job_restarts=0,
                                                                           num_job_retries_on_failure=2))
    job.wait(timeout=400)
    # NeMo-Run's template ends the last attempt with the shell's status of its own check (0), so Slurm
    # says COMPLETED: what shows the stop is the attempts, each counted failed, and no further requeue
    assert job.record.restarts == 1 and job.attempts() == ["F", "F"], (job.record, job.attempts())
    assert not job.finished()
    launcher_exits = [e["exit_code"] for e in kinds(job.events(), "launcher_exit")]
    assert launcher_exits and all(code != 0 for code in launcher_exits), launcher_exits


def test_preemption_by_the_time_limit_signal_requeues_without_a_failed_attempt(tmp_path, weights):
    # slurmctld sends the warning at its first periodic check (every 30 s) that is within 30 s of the
    # signal's time: with a 2-minute limit and the signal 60 s before it, 30-60 s into each attempt.
    # 54 s of training outlasts the first attempt; most jobs finish in the second or third.
    job = Job(tmp_path, script(tmp_path, step_time=0.45), [FaultTolerancePlugin(**FT), PreemptionPlugin(preempt_time=60)],
              time_limit="00:02:00")
    job.wait(timeout=800)
    assert_finished_like_the_reference(job, weights)
    assert job.record.restarts >= 1 and set(job.attempts()) == {"S"}, (job.record, job.attempts())
    events = job.events()
    exits = [e["exit_code"] for e in kinds(events, "launcher_exit")]
    assert exits.count(18) == 2 * job.record.restarts and exits[-2:] == [0, 0], exits   # each node, each attempt
    # every rank of an attempt stopped at the same step (four records a step, one step an attempt)
    steps = [e["step"] for e in kinds(events, "preemption_agreed")]
    assert sorted(steps.count(step) for step in set(steps)) == [4] * job.record.restarts, steps
    # `nvrx report` on the one events file of every attempt: each attempt's launchers told apart,
    # every step timed once (each attempt resumed where the last one saved), no failure
    report = build_report(str(tmp_path / "events.jsonl"))
    assert len(kinds(events, "launcher_started")) == len({e["launcher"] for e in events}) == 2 * len(job.attempts())
    assert report.incidents == [] and report.goodput.steps_kept == ITERS, report.text()
    assert report.goodput.steps_redone == 0 and report.goodput.seconds["requeue"] > 0, report.text()
