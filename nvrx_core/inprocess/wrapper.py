"""Wrapper: run a distributed training function, and restart it in-process after a fault.

    wrapper = Wrapper(soft_timeout=60, hard_timeout=90, max_iterations=10)

    @wrapper
    def train(state: RestartState):
        state.init_process_group("nccl")
        ...

When any rank raises, hangs or dies, every healthy rank is interrupted, the distributed
state is aborted and destroyed, health checks run, ranks are reassigned (warm reserves
step in), and the function is called again with state.iteration + 1. The processes, the
imported modules, the CUDA context and whatever the function kept in memory survive.
"""

import dataclasses
import faulthandler
import functools
import gc
import inspect
import logging
import os
import signal
import socket
import time
import traceback
import typing
from typing import Any, Callable, Dict, Optional, Tuple

from nvrx_core import events as ev
from nvrx_core.inprocess.abort import AbortProcessGroups, IterationConnections
from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.inprocess.coordination import Coordinator, Poller
from nvrx_core.inprocess.errors import InProcessGaveUp, RankExcluded, RestartRequested
from nvrx_core.inprocess.health_gate import HealthGate
from nvrx_core.inprocess.interruption import MainThreadInterrupter, MainThreadProgress
from nvrx_core.inprocess.monitor_process import MonitorProcess, MonitorSettings
from nvrx_core.inprocess.monitor_thread import MonitorThread
from nvrx_core.inprocess.planning import ACTIVE, OUT, Plan, first_plan, next_plan
from nvrx_core.inprocess.rank_assignment import Policy, default_policy
from nvrx_core.inprocess.records import (ABORTED, COMPLETED, EXCLUDED, GAVE_UP, INTERRUPTED, REASSIGNED, RESTARTED,
                                         Cause)
from nvrx_core.inprocess.state import RestartState
from nvrx_core.inprocess.store import StoreClients, endpoint_from_env

logger = logging.getLogger("nvrx.inprocess")

_COMPLETED = object()


class Wrapper:
    """Decorator (or callable) adding in-process restart to a distributed training function.

    Parameters are those of InProcessConfig (pass `config=` or keywords), plus:
    health_check: a callable run on each rank after a fault, before the restart barrier;
        it returns a HealthResult, a list of them, or (healthy, detail). An unhealthy rank
        leaves the job (RankExcluded) and a reserve or the remaining ranks go on.
    rank_assignment: a rank_assignment policy (default: whole nodes if granularity="node",
        then reserves, then shift ranks down).
    """

    def __init__(self, config: Optional[InProcessConfig] = None, *, health_check: Optional[Callable] = None,
                 rank_assignment: Optional[Policy] = None, **overrides: Any):
        base = config or InProcessConfig()
        self.config = dataclasses.replace(base, **overrides) if overrides else base
        self.health_check = health_check
        self.rank_assignment = rank_assignment or default_policy(self.config.granularity)
        self._calls = 0

    def __call__(self, fn: Callable) -> Callable:
        if not self.config.enabled:
            return fn
        state_param = _state_parameter(fn)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            self._calls += 1
            name = f"{fn.__module__}.{fn.__qualname__}/{self._calls}"
            return _Call(self, fn, state_param, name).run(args, kwargs)

        return wrapped


def _state_parameter(fn: Callable) -> Optional[str]:
    """The parameter annotated RestartState (or Optional[RestartState]), if any."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = getattr(fn, "__annotations__", {})
    for name in inspect.signature(fn).parameters:
        hint = hints.get(name)
        if hint is RestartState or RestartState in typing.get_args(hint):
            return name
    return None


def _clear_frames(error: BaseException) -> None:
    """Drop the locals of every frame in the error's tracebacks, chained errors included.

    Those locals (a DDP model, a process group resolved inside torch.distributed) keep the
    failed iteration's groups alive. Freed here, while the Wrapper still holds the groups,
    their last reference dies in the reaper thread, not later in the main thread, where
    destroying a group whose gloo worker waits out its timeout would stall the rank.
    """
    pending, seen = [error], set()
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]


def _is_communication_error(error: BaseException) -> bool:
    """A collective that failed, most likely because another rank did (logged without a traceback)."""
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or "gloo/transport" in str(error) or "NCCL" in str(error)


class _Call:
    """One invocation of a wrapped function: setup, the restart loop, teardown."""

    def __init__(self, wrapper: Wrapper, fn: Callable, state_param: Optional[str], name: str):
        self.config = wrapper.config
        self.policy = wrapper.rank_assignment
        self.health = HealthGate(wrapper.health_check)
        self.fn, self.state_param, self.name = fn, state_param, name
        env = os.environ
        self.rank, self.world_size = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.node = env.get("GROUP_RANK") or socket.gethostname()
        self.events = ev.EventLog.from_env(source="inprocess")
        self.saved_env = {k: env.get(k) for k in ("RANK", "WORLD_SIZE")}
        self.completed = False
        self.coord = self.abort = self.interrupter = self.monitor = self.monitor_process = None
        self.froze_gc = False

    # ---- setup / teardown --------------------------------------------------------------
    def run(self, args: Tuple, kwargs: Dict) -> Any:
        self.config.check_world(self.world_size)
        endpoint = endpoint_from_env(os.environ)
        self.clients = StoreClients(endpoint, self.rank, self.world_size, timeout=self.config.barrier_timeout)
        prefix = f"{endpoint.key_prefix}/{self.name}"
        try:
            self.coord = Coordinator(self.clients.connect(), prefix, self.rank)
            self.nodes = self.coord.initial_barrier(self.node, self.world_size, self.config.barrier_timeout)
            # Objects that exist now (modules, torch internals) are not garbage from a failed
            # iteration: keep them out of the full collection every restart runs (0.2-0.7 s).
            gc.freeze()
            self.froze_gc = True
            protected = endpoint.port if self.clients.server is not None else None
            self.abort = AbortProcessGroups(IterationConnections(protected), self.config.empty_cuda_cache)
            self.interrupter = MainThreadInterrupter(self.config.signal_number("interrupt_signal"))
            self.interrupter.install()
            self.monitor_process = self._start_monitor_process(prefix)
            self.monitor = MonitorThread(Coordinator(self.clients.connect(), prefix, self.rank), self.config,
                                         self.interrupter, MainThreadProgress(), self.abort,
                                         self.monitor_process, self.events)
            self.monitor.start()
            return self._loop(first_plan(self.nodes, self.config), args, kwargs)
        except BaseException as e:
            self._leave_abnormally(e)
            raise
        finally:
            self._teardown()

    def _start_monitor_process(self, prefix: str) -> MonitorProcess:
        log_path = None
        if self.config.monitor_log_dir:
            os.makedirs(self.config.monitor_log_dir, exist_ok=True)
            log_path = os.path.join(self.config.monitor_log_dir, f"monitor_rank{self.rank}.log")
        settings = MonitorSettings(self.rank, self.config.hard_timeout, self.config.termination_grace,
                                   self.config.signal_number("termination_signal"),
                                   min(self.config.monitor_interval, 0.5), log_path,
                                   self.config.signal_number("stack_dump_signal"))
        dump = settings.stack_dump_signal
        if dump is not None and signal.getsignal(dump) == signal.SIG_DFL:  # no Python handler claims it
            # Left registered afterwards: ft_launcher's node monitor expects the same stack dump
            # on this signal, and a dump is a better default than dying.
            faulthandler.register(dump, all_threads=True, chain=False)
        clients, rank = self.clients, self.rank

        def declare(cause: Cause, detail: str) -> None:  # runs in the monitor process
            Coordinator(clients.connect(), prefix, rank).mark_terminated(rank, cause, detail)

        process = MonitorProcess(settings, declare)
        process.start()
        return process

    def _leave_abnormally(self, error: BaseException) -> None:
        """Leaving with an error peers cannot see: declare this rank gone so nobody waits for it."""
        if isinstance(error, (InProcessGaveUp, RankExcluded)) or self.coord is None:
            return
        try:
            self.coord.mark_terminated(self.rank, Cause.EXITED, f"left the Wrapper: {error!r}"[:500])
        except Exception as e:
            logger.debug("could not declare rank %d terminated: %s", self.rank, e)

    def _teardown(self) -> None:
        if self.interrupter is not None:
            self.interrupter.disarm()
        if self.monitor is not None:
            self.monitor.shutdown()
        if self.monitor_process is not None:
            self.monitor_process.stop()
        if self.abort is not None:
            if not self.completed:
                self.abort.destroy()
            self.abort.release()
        if self.interrupter is not None:
            self.interrupter.uninstall()
        if self.froze_gc:
            gc.unfreeze()
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        try:
            if self.coord is not None:
                self.coord.leave()
                if self.clients.server is not None:  # others still need the store this rank hosts
                    expected = self.world_size - len(self.coord.terminated())
                    self.coord.wait_for_leavers(expected, timeout=min(self.config.barrier_timeout, 30.0))
        except Exception as e:
            logger.debug("leaving the in-process store failed: %s", e)
        self.clients.close()

    # ---- the restart loop ----------------------------------------------------------------
    def _loop(self, plan: Plan, args: Tuple, kwargs: Dict) -> Any:
        while True:
            role = plan.role(self.rank)
            if role == OUT:
                self._leave_excluded(plan)
            if plan.give_up:
                self.events.emit(GAVE_UP, iteration=plan.iteration, reason=plan.give_up)
                logger.error("in-process restart gives up: %s", plan.give_up)
                raise InProcessGaveUp(plan.give_up)
            if plan.iteration > 0:
                self.events.emit(RESTARTED, iteration=plan.iteration, rank_now=plan.assignment.active[self.rank],
                                 world_size=plan.assignment.world_size, role=role)
            outcome, value = self._run_iteration(plan, role, args, kwargs)
            if outcome is _COMPLETED:
                self.completed = True
                self.events.emit(COMPLETED, iteration=plan.iteration, role=role)
                return value
            error, value = value, None  # _restart drops the last reference to the failed iteration's error
            plan = self._restart(plan, outcome, error)

    def _run_iteration(self, plan: Plan, role: str, args: Tuple, kwargs: Dict):
        """(_COMPLETED, return value) or (cause-or-None, exception-or-None)."""
        k = plan.iteration
        self.abort.connections.begin()
        self.monitor.begin_iteration(k, plan.members(), plan.marked, in_function=role == ACTIVE)
        if role != ACTIVE:
            return self._wait(plan, deadline=None)
        state = self._state(plan)
        os.environ.update(RANK=str(state.rank), WORLD_SIZE=str(state.world_size))
        if self.state_param:
            kwargs = {**kwargs, self.state_param: state}
        error: Optional[BaseException] = None
        self.interrupter.arm()
        try:
            result = self.fn(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # RestartRequested included
            error = e
        finally:
            self.interrupter.disarm()
            self.monitor.leave_function()
        del state, kwargs
        if error is not None:
            return None, error
        self.coord.mark_done(k)
        outcome, _ = self._wait(plan, deadline=self.config.completion_timeout)
        if outcome is _COMPLETED:
            self.abort.release()  # groups the function left behind die now, with their threads idle
        return (_COMPLETED, result) if outcome is _COMPLETED else (outcome, None)

    def _state(self, plan: Plan) -> RestartState:
        import torch.distributed as dist

        prefix = f"{self.coord.iteration_prefix(plan.iteration)}/pg"
        store = dist.PrefixStore(prefix, self.clients.connect())  # opened inside the iteration: aborted with it
        return RestartState(
            iteration=plan.iteration, rank=plan.assignment.active[self.rank], world_size=plan.assignment.world_size,
            initial_rank=self.rank, initial_world_size=self.world_size, local_rank=self.local_rank,
            store=store, store_prefix=prefix, previous_interruptions=plan.previous,
            terminated_ranks=frozenset(plan.causes), _atomic=self.interrupter.atomic,
            _group_created=self.abort.hold_current,
            _gloo_timeout=(self.config.soft_timeout + self.config.hard_timeout) / 2,
        )

    def _wait(self, plan: Plan, deadline: Optional[float]):
        """Wait until every active rank finished the iteration, or something interrupted it."""
        k, world = plan.iteration, plan.assignment.world_size
        poller, start = Poller(), time.monotonic()
        while True:
            if self.coord.done_count(k) >= world:
                return _COMPLETED, None
            if self.coord.interrupted(k, plan.marked):
                return Cause.PEER_INTERRUPTED, None
            waited = time.monotonic() - start
            if deadline is not None and waited > deadline:
                detail = f"rank {self.rank} waited {waited:.0f} s for {world - self.coord.done_count(k)} ranks"
                self.coord.record(k, Cause.COMPLETION_TIMEOUT, detail)
                return Cause.COMPLETION_TIMEOUT, None
            poller.wait()

    def _restart(self, plan: Plan, cause: Optional[Cause], error: Optional[BaseException]) -> Plan:
        k = plan.iteration
        cause, detail = self._classify(plan, cause, error)
        self.events.emit(INTERRUPTED, iteration=k, cause=cause.value, detail=detail, by="main")
        self.monitor.end_iteration()
        shut = self.abort.abort_communication()
        self.abort.destroy()
        self.events.emit(ABORTED, iteration=k, connections_shut_down=shut, by="main")
        if error is not None:
            _clear_frames(error)
            error = None
        healthy, results = self.health.run(self.events, k)
        if not healthy:
            self.coord.mark_terminated(self.rank, Cause.HEALTH_CHECK, "; ".join(r.detail for r in results))
            raise RankExcluded(f"rank {self.rank} failed its health check after iteration {k}")
        self.coord.arrive(k)
        _, marks = self.coord.wait_for_members(
            k, plan.members(), plan.marked, self.config.barrier_timeout, self.config.heartbeat_timeout,
            self.config.heartbeat_interval, on_lost=lambda r: self._declare_lost(k, r))
        winning = self.coord.propose_plan(k, self._proposal(plan, marks))
        new_plan = Plan.from_json(winning, self.nodes)
        self.abort.release()
        self.events.emit(REASSIGNED, iteration=new_plan.iteration, rank_now=new_plan.assignment.active[self.rank],
                         world_size=new_plan.assignment.world_size, out=sorted(new_plan.causes),
                         reserves=len(new_plan.assignment.reserves()))
        return new_plan

    def _proposal(self, plan: Plan, marks: Dict[int, str]) -> str:
        records = self.coord.records(plan.iteration)
        return next_plan(plan, records, marks, self.config, self.policy).to_json()

    def _classify(self, plan: Plan, cause: Optional[Cause], error: Optional[BaseException]) -> Tuple[Cause, str]:
        """Record why this rank left the iteration, unless the monitor already did."""
        k, triggered = plan.iteration, self.monitor.triggered
        if isinstance(error, RestartRequested) or triggered is not None:
            cause = triggered or Cause.PEER_INTERRUPTED
            detail = str(error) if error is not None else "interrupted"
            if cause != Cause.SOFT_TIMEOUT:  # the monitor recorded soft timeouts itself
                self.coord.record(k, cause, detail)
            return cause, detail
        if error is not None:
            detail = f"{type(error).__name__}: {error}"[:1000]
            cause = Cause.PEER_INTERRUPTED if self.coord.interrupted(k, plan.marked) else Cause.EXCEPTION
            self.coord.record(k, cause, detail)
            if cause == Cause.EXCEPTION and not _is_communication_error(error):
                logger.error("rank %d iteration %d: %s", self.rank, k, detail,
                             exc_info=(type(error), error, error.__traceback__))
            else:
                logger.warning("rank %d iteration %d: %s", self.rank, k, detail)
            return cause, detail
        return cause, "interrupted while waiting for the other ranks"

    def _declare_lost(self, iteration: int, rank: int) -> None:
        detail = f"no heartbeat for {self.config.heartbeat_timeout} s at the restart barrier"
        if self.coord.mark_terminated(rank, Cause.HEARTBEAT_LOST, detail):
            self.coord.record(iteration, Cause.HEARTBEAT_LOST, detail, rank=rank)

    def _leave_excluded(self, plan: Plan) -> None:
        cause = plan.causes[self.rank]
        self.events.emit(EXCLUDED, iteration=plan.iteration, cause=cause, faults=plan.faults.get(self.rank, 0))
        if cause == Cause.MAX_RANK_FAULTS.value:
            raise InProcessGaveUp(f"rank {self.rank} caused {plan.faults.get(self.rank)} faults, more than "
                                  f"max_rank_faults={self.config.max_rank_faults}")
        raise RankExcluded(f"rank {self.rank} is out of the job ({cause})")
