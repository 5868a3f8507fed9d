"""A restart request that arrives as the wrapped function returns: a clean ending, the same on every rank.

Two real ranks call a wrapped function many times (one Wrapper call per trial). In every
trial both ranks meet at a store barrier and return together, while a restart request is
timed at the return:
- interrupt_at_return: the interrupt signal itself, from a kernel timer armed just before
  `return`. Its delay is drawn over the last moments of the function (a short Python
  loop) and the return itself, which frees a large local (about a millisecond of C code,
  no bytecode): the signal lands before the return (a restart), during the teardown (its
  handler then runs at the next bytecode, the Wrapper's) or after (nothing to do);
- peer_fault_at_return: the peer raises right after the barrier, so this rank's monitor
  thread interrupts it around its return;
- soft_timeout_at_return: the rank's soft timeout fires while it is already on its way
  out (the interruption cannot reach it before it returns), so the store holds an
  interruption record of an iteration whose function returned on every rank.
Each trial must end as a completion or as a restart, never as a crash, and every rank
must see the same ending.
"""

import os
import random
import signal
import time

import pytest

from test_inprocess_multirank import launch

QUICK = dict(soft_timeout=3.0, hard_timeout=6.0, heartbeat_interval=0.2, heartbeat_timeout=5.0, monitor_interval=0.01,
             barrier_timeout=30.0, completion_timeout=30.0, termination_grace=1.0)


def _barrier(store, world, name):
    """Both ranks leave within microseconds of each other (polling keeps the main thread in Python)."""
    store.add(name, 1)
    while store.add(name, 0) < world:
        time.sleep(0.0005)


def race_job(params):
    from nvrx_core.inprocess import InProcessGaveUp, RestartRequested, RestartState, Wrapper

    rank, world, mode = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), params["mode"]
    rng = random.Random(1000 + rank)
    config = {**QUICK, **params.get("config", {})}
    if mode == "interrupt_at_return":
        signal.signal(signal.SIGALRM, lambda *_: None)  # what the Wrapper restores: a late timer is harmless
    outcomes, seen = [], []

    @Wrapper(**config)
    def step(state: RestartState):
        seen.append(state.iteration)
        if state.iteration > 0:
            return state.iteration
        _barrier(state.store, world, "at_return")
        if mode == "interrupt_at_return" and rank == 0:
            ballast = [float(i) for i in range(200_000)]  # noqa: F841 - freed by the return
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 1.8e-3))
            spin_until = time.perf_counter() + 3e-4
            while time.perf_counter() < spin_until:
                pass
            return state.iteration
        if mode == "peer_fault_at_return" and rank == 1:
            spin_until = time.perf_counter() + rng.uniform(0, 0.002)
            while time.perf_counter() < spin_until:
                pass
            raise ValueError("peer fault at the return")
        if mode == "soft_timeout_at_return" and rank == 1:
            # The soft timeout fires during this C call; its interruption stays pending (blocked)
            # until after the return, as for a call that ends just as the monitor acts.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
            try:
                time.sleep(config["soft_timeout"] + 0.3)
            except RestartRequested:
                pass
        return state.iteration

    for trial in range(params["trials"]):
        seen.clear()
        try:
            step()
            outcomes.append(["completed", list(seen)])
        except InProcessGaveUp as e:
            outcomes.append(["gave_up", list(seen), e.reason])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if mode == "soft_timeout_at_return":  # drop the interruption that never got through
                while signal.sigtimedwait({signal.SIGUSR1}, 0) is not None:
                    pass
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    return {"outcomes": outcomes}


def run_trials(tmp_path, mode, trials, timeout, config=None):
    run = launch(tmp_path, race_job, {"mode": mode, "trials": trials, "config": config or {}}, timeout=timeout,
                 world=2)
    assert run.codes == [0, 0], run.explain()
    outcomes = [run.result(r)["outcomes"] for r in range(2)]
    assert len(outcomes[0]) == len(outcomes[1]) == trials, run.explain()
    for trial, (a, b) in enumerate(zip(*outcomes)):
        assert a[:2] == b[:2], f"trial {trial}: rank 0 {a}, rank 1 {b}\n{run.explain()}"
    return outcomes[0], run


@pytest.mark.timeout(300)
def test_interrupt_timed_at_the_return_never_escapes_the_wrapper(tmp_path):
    outcomes, run = run_trials(tmp_path, "interrupt_at_return", trials=16, timeout=280,
                               config={"interrupt_signal": "SIGALRM"})
    endings = {tuple(o[1]) for o in outcomes}
    assert endings <= {(0,), (0, 1)}, endings
    assert not run.kinds("rank_killed")


@pytest.mark.timeout(300)
def test_a_peer_fault_at_the_return_restarts_every_rank(tmp_path):
    outcomes, run = run_trials(tmp_path, "peer_fault_at_return", trials=10, timeout=280)
    assert all(o == ["completed", [0, 1]] for o in outcomes), outcomes


@pytest.mark.timeout(300)
def test_a_soft_timeout_as_the_function_returns_ends_the_same_way_on_every_rank(tmp_path):
    config = {"soft_timeout": 0.6, "hard_timeout": 3.0, "monitor_interval": 0.05}
    outcomes, run = run_trials(tmp_path, "soft_timeout_at_return", trials=6, timeout=280, config=config)
    assert all(o[0] == "completed" for o in outcomes), outcomes
    soft = [e for e in run.kinds("inprocess_interrupted") if e["cause"] == "soft_timeout" and e["by"] == "monitor"]
    assert {e["rank"] for e in soft} == {1}, run.explain()
