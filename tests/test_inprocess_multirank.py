"""In-process restart with 4 real processes on gloo: exceptions, hangs, killed ranks, limits.

Each test starts 4 ranks (forked from a server that has already imported torch, so a test
pays for its scenario, not for 4 interpreter starts). The test process hosts the
coordination store, as ft_launcher's agent does, so it survives any rank's death.
"""

import ctypes
import json
import logging
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from nvrx_core.events import read_events
from nvrx_core.exit_codes import ExitCode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from inprocess_ddp import resume  # noqa: E402  (the example's own restore, tested here on 4 ranks)
from harness.ranks import spawn_ranks

WORLD = 4
FAST = dict(soft_timeout=3.0, hard_timeout=6.0, heartbeat_interval=0.2, heartbeat_timeout=5.0, monitor_interval=0.1,
            barrier_timeout=30.0, completion_timeout=30.0, termination_grace=1.0)
STEPS = 16


# ---- what each rank runs ------------------------------------------------------------------
def _rank_main(rank, world, port, outdir, job, params):
    os.environ.update(RANK=str(rank), NVRX_TEST_INITIAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1",
                      NVRX_EVENTS_FILE=os.path.join(outdir, "events.jsonl"), **params.get("env", {}).get(str(rank), {}))
    log = open(os.path.join(outdir, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank} %(asctime)s] %(name)s %(message)s", force=True)
    torch.set_num_threads(1)
    result = (JOBS[job] if isinstance(job, str) else job)(params)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _inject(params, state, step):
    """The fault of this test, once, on the chosen initial rank."""
    fault = params.get("fault")
    if not fault or state.initial_rank != params["fault_rank"] or step != params.get("fault_step", 5):
        return
    iterations = params.get("fault_iterations", (0,))
    if iterations != "all" and state.iteration not in iterations:
        return
    if params.get("fault_marker"):  # tells the test when the fault begins (wall time)
        with open(params["fault_marker"] + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.replace(params["fault_marker"] + ".tmp", params["fault_marker"])
    if fault == "exception":
        raise ValueError(f"injected fault at step {step}")
    if fault == "sleep":  # GIL released: soft timeout
        time.sleep(3600)
    if fault == "gil":  # a C call holding the GIL (PyDLL does not release it) that no signal breaks
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
        ctypes.PyDLL(None).sleep(3600)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def ddp_job(params):
    """Deterministic DDP training that resumes from an in-memory snapshot after a restart."""
    from nvrx_core.inprocess import RestartState, Wrapper

    snapshots = {}  # step -> model state after that step (the last two are kept)
    iterations = []

    @Wrapper(**{**FAST, **params.get("config", {})})
    def train(state: RestartState):
        iterations.append((state.iteration, state.rank, state.world_size))
        state.init_process_group("gloo")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        step = resume(model, snapshots, state)  # the example's: newest common step, from a peer
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        while step < STEPS:
            _inject(params, state, step)
            data = torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * step + state.rank))
            loss = ddp(data).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
            snapshots.pop(step - 2, None)
        return [p.detach().tolist() for p in model.parameters()]

    weights = train()
    return {"weights": weights, "iterations": iterations}


def loop_job(params):
    """A plain all-reduce loop (no DDP): for tests about limits, not about numerics."""
    from nvrx_core.health import CudaHealthCheck, HealthCheckChain, HealthResult, Status
    from nvrx_core.inprocess import RestartState, Wrapper

    seen = []

    def health_check():  # the real checks are "not applicable" here: this one fails on demand
        healthy = int(os.environ["NVRX_TEST_INITIAL_RANK"]) != params.get("unhealthy_rank")
        return HealthResult("test", Status.HEALTHY if healthy else Status.UNHEALTHY, "simulated GPU fault")

    @Wrapper(**{**FAST, **params.get("config", {})}, health_check=HealthCheckChain(CudaHealthCheck(), health_check))
    def train(state: RestartState):
        seen.append((state.iteration, state.rank, state.world_size))
        state.init_process_group("gloo")
        for step in range(params.get("steps", 8)):
            _inject(params, state, step)
            dist.all_reduce(torch.ones(4))
        if state.initial_rank == params.get("linger_rank"):  # busy in Python (progress), never finishing
            while True:
                time.sleep(0.01)
        return state.rank

    return {"rank": train(), "iterations": seen}


JOBS = {"ddp_job": ddp_job, "loop_job": loop_job}


# ---- the harness --------------------------------------------------------------------------
class Run:
    def __init__(self, outdir, codes, world=WORLD):
        self.outdir, self.codes, self.world = outdir, codes, world
        self.events = read_events(os.path.join(outdir, "events.jsonl"))

    def result(self, rank):
        path = os.path.join(self.outdir, f"rank{rank}.json")
        return json.load(open(path)) if os.path.exists(path) else None

    def log(self, rank):
        path = os.path.join(self.outdir, f"rank{rank}.log")
        return open(path).read() if os.path.exists(path) else ""

    def kinds(self, kind):
        return [e for e in self.events if e["kind"] == kind]

    def explain(self):
        """Exit codes and each rank's log, without the C++ frames of torch's error messages."""
        def readable(rank):
            lines = [line for line in self.log(rank).splitlines() if not line.lstrip().startswith("frame #")]
            return "\n".join(lines)[-4000:]
        timeline = "\n".join(f"{e['time']:.3f} rank {e.get('rank')} {e['kind']} iteration={e.get('iteration')} "
                             f"{e.get('cause') or e.get('reason') or ''}" for e in self.events)
        return (f"exit codes {self.codes}\n--- events\n{timeline}\n" +
                "\n".join(f"--- rank {r}\n{readable(r)}" for r in range(self.world)))


def launch(tmp_path, job, params, timeout=90.0, world=WORLD, store_port=None, during=None) -> Run:
    """Run `job` (a name in JOBS, or a module-level function) on `world` ranks (harness.ranks);
    kill what is left after `timeout` s.

    store_port: a store hosted elsewhere (default: one hosted here, like ft_launcher's agent).
    during(procs): called once the ranks started, to act on them or on the store meanwhile.
    """
    outdir = str(tmp_path)
    codes = spawn_ranks(_rank_main, world, outdir, (job, params), timeout, store_port=store_port, during=during,
                        explain=lambda codes: Run(outdir, codes, world).explain())
    return Run(outdir, codes, world)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same DDP job without any fault."""
    run = launch(tmp_path_factory.mktemp("reference"), "ddp_job", {})
    assert run.codes == [0] * WORLD, run.explain()
    return run.result(0)["weights"]


# ---- the tests ----------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_exception_restarts_all_ranks_in_process_with_identical_weights(tmp_path, reference):
    run = launch(tmp_path, "ddp_job", {"fault": "exception", "fault_rank": 1})
    assert run.codes == [0] * WORLD, run.explain()
    for rank in range(WORLD):
        result = run.result(rank)
        # one restart; under load a restarted iteration may end in a soft timeout and run again unchanged
        assert [it[0] for it in result["iterations"]][:2] == [0, 1], run.explain()
        assert all(it[1:] == [rank, WORLD] for it in result["iterations"]), run.explain()
        assert result["weights"] == reference, f"rank {rank} ended with different weights"
    causes = {(e["rank"], e["cause"]) for e in run.kinds("inprocess_interrupted") if e["by"] == "main"}
    assert (1, "exception") in causes and {r for r, c in causes if c == "peer_interrupted"} == {0, 2, 3}
    assert len(run.kinds("inprocess_restarted")) == WORLD


@pytest.mark.timeout(150)
def test_hang_with_gil_released_ends_in_soft_timeout(tmp_path, reference):
    run = launch(tmp_path, "ddp_job", {"fault": "sleep", "fault_rank": 2})
    assert run.codes == [0] * WORLD, run.explain()
    soft = [e for e in run.kinds("inprocess_interrupted") if e["cause"] == "soft_timeout"]
    assert soft, run.explain()
    assert all(run.result(r)["weights"] == reference for r in range(WORLD))
    assert not run.kinds("rank_killed")


@pytest.mark.timeout(150)
def test_hang_holding_the_gil_is_killed_by_the_hard_timeout(tmp_path):
    monitor_logs = tmp_path / "monitor"
    config = {"heartbeat_timeout": 20.0,  # the kill, not a missed heartbeat, must end this hang
              "monitor_log_dir": str(monitor_logs)}
    run = launch(tmp_path, "loop_job", {"fault": "gil", "fault_rank": 2, "config": config})
    assert run.codes[2] == -signal.SIGTERM, run.explain()
    assert [run.codes[r] for r in (0, 1, 3)] == [0, 0, 0], run.explain()
    killed = run.kinds("rank_killed")
    assert [(e["rank"], e["reason"]) for e in killed] == [(2, "hard_timeout")], run.explain()
    assert "most recent call first" in run.log(2)  # faulthandler's stack dump before the kill
    assert "hard_timeout=6.0 s; killing it" in (monitor_logs / "monitor_rank2.log").read_text()
    for rank, new_rank in ((0, 0), (1, 1), (3, 2)):  # shifted down to close the gap
        assert run.result(rank)["iterations"][-1][1:] == [new_rank, 3], run.explain()


@pytest.mark.timeout(150)
def test_killed_rank_is_replaced_by_a_reserve(tmp_path):
    params = {"fault": "kill", "fault_rank": 1, "config": {"active_world_size": 3}}
    run = launch(tmp_path, "ddp_job", params)
    assert run.codes[1] == -signal.SIGKILL and [run.codes[r] for r in (0, 2, 3)] == [0, 0, 0], run.explain()
    # The reserve takes the killed rank's place (rank 1 of 3) from iteration 1 on. Under load a
    # restarted iteration may itself end in a soft timeout (3 s), and run once more unchanged.
    reserve, first = run.result(3)["iterations"], run.result(0)["iterations"]
    assert reserve[0] == [1, 1, 3] and all(it[1:] == [1, 3] for it in reserve), run.explain()
    assert first[0] == [0, 0, 3] and all(it[1:] == [0, 3] for it in first) and len(first) == len(reserve) + 1
    assert run.result(0)["weights"] == run.result(2)["weights"] == run.result(3)["weights"]
    terminated = run.kinds("inprocess_rank_terminated")
    assert [(e["rank"], e["cause"]) for e in terminated] == [(1, "exited")], run.explain()


@pytest.mark.timeout(120)
def test_max_iterations_stops_every_rank_with_exit_code_22(tmp_path):
    params = {"fault": "exception", "fault_rank": 1, "fault_iterations": "all", "config": {"max_iterations": 2}}
    run = launch(tmp_path, "loop_job", params)
    assert run.codes == [ExitCode.INPROCESS_GAVE_UP] * WORLD, run.explain()
    gave_up = run.kinds("inprocess_gave_up")
    assert len(gave_up) == WORLD and all("max_iterations=2" in e["reason"] for e in gave_up)
    assert all("Traceback" not in run.log(r).split("gives up")[-1] for r in range(WORLD))


@pytest.mark.timeout(120)
def test_max_rank_faults_excludes_the_faulty_rank_and_a_reserve_steps_in(tmp_path):
    params = {"fault": "exception", "fault_rank": 1, "fault_iterations": "all",
              "config": {"max_rank_faults": 1, "active_world_size": 3}}
    run = launch(tmp_path, "loop_job", params)
    assert run.codes == [0, ExitCode.INPROCESS_GAVE_UP, 0, 0], run.explain()
    assert run.result(3)["iterations"] == [[2, 1, 3]]  # iteration 2: the reserve has rank 1
    excluded = run.kinds("inprocess_excluded")
    assert [(e["rank"], e["cause"], e["faults"]) for e in excluded] == [(1, "max_rank_faults", 2)]


@pytest.mark.timeout(120)
def test_a_rank_failing_its_health_check_after_a_fault_is_excluded(tmp_path):
    run = launch(tmp_path, "loop_job", {"fault": "exception", "fault_rank": 0, "unhealthy_rank": 2})
    assert run.codes[2] == 1 and "failed its health check" in run.log(2), run.explain()
    assert [run.codes[r] for r in (0, 1, 3)] == [0, 0, 0], run.explain()
    assert run.result(3)["iterations"][-1] == [1, 2, 3]
    checks = [(e["rank"], e["check"], e["status"]) for e in run.kinds("health_check")]
    assert (2, "test", "unhealthy") in checks and (2, "cuda", "not_applicable") in checks
    assert (0, "test", "healthy") in checks


@pytest.mark.timeout(120)
def test_a_rank_that_never_finishes_ends_in_completion_timeout(tmp_path):
    run = launch(tmp_path, "loop_job", {"linger_rank": 2, "config": {"completion_timeout": 2.0}})
    assert run.codes == [ExitCode.INPROCESS_GAVE_UP] * WORLD, run.explain()
    assert all("completion_timeout=2.0 s expired" in e["reason"] for e in run.kinds("inprocess_gave_up"))


@pytest.mark.timeout(120)
def test_too_few_ranks_left_gives_up_everywhere(tmp_path):
    params = {"fault": "kill", "fault_rank": 2, "config": {"min_active_world_size": 4}}
    run = launch(tmp_path, "loop_job", params)
    assert run.codes[2] == -signal.SIGKILL, run.explain()
    assert [run.codes[r] for r in (0, 1, 3)] == [ExitCode.INPROCESS_GAVE_UP] * 3, run.explain()
    assert all("min_active_world_size=4" in e["reason"] for e in run.kinds("inprocess_gave_up"))


@pytest.mark.timeout(120)
def test_node_granularity_excludes_the_whole_node(tmp_path):
    env = {str(r): {"GROUP_RANK": str(r // 2)} for r in range(WORLD)}  # two "nodes" of two ranks
    params = {"fault": "kill", "fault_rank": 1, "env": env,
              "config": {"granularity": "node", "active_world_size": 2}}
    run = launch(tmp_path, "loop_job", params)
    assert run.codes[1] == -signal.SIGKILL and run.codes[0] == 1, run.explain()  # rank 0: RankExcluded
    assert "excluded_by_policy" in run.log(0)
    assert run.codes[2:] == [0, 0], run.explain()
    assert run.result(2)["iterations"] == [[1, 0, 2]] and run.result(3)["iterations"] == [[1, 1, 2]]


def test_bad_parameters_fail_before_anything_starts(monkeypatch):
    from nvrx_core.config import ConfigError
    from nvrx_core.inprocess import Wrapper

    with pytest.raises(ConfigError, match="soft_timeout < hard_timeout < barrier_timeout"):
        Wrapper(soft_timeout=10, hard_timeout=5)
    calls = []
    wrapped = Wrapper(active_world_size=8)(lambda: calls.append(1))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"active_world_size=8: must be <= the world size \(4\)"):
        wrapped()
    assert calls == []
