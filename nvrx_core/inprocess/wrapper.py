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
import functools
import gc
import inspect
import logging
import os
import time
import typing
from typing import Any, Callable, Dict, Optional, Tuple

from nvrx_core import dist_env
from nvrx_core import events as ev
from nvrx_core.inprocess.abort import AbortProcessGroups, IterationConnections, open_sockets, peer_port
from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.inprocess.coordination import COMPLETED as SETTLED_COMPLETED
from nvrx_core.inprocess.coordination import RESTART as SETTLED_RESTART
from nvrx_core.inprocess.coordination import Coordinator, Poller
from nvrx_core.inprocess.errors import (InProcessGaveUp, RankExcluded, RestartRequested, clear_frames,
                                        is_communication_error)
from nvrx_core.inprocess.health_gate import HealthGate
from nvrx_core.inprocess.interruption import MainThreadInterrupter
from nvrx_core.inprocess import replacement
from nvrx_core.inprocess.planning import ACTIVE, OUT, Plan, first_plan, next_plan
from nvrx_core.inprocess.rank_assignment import Policy, default_policy, node_of
from nvrx_core.inprocess.records import Cause
from nvrx_core.inprocess.state import RestartState
from nvrx_core.inprocess.store import StoreClients, endpoint_from_env
from nvrx_core.inprocess.watchdogs import Watchdogs

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


class _Call:
    """One invocation of a wrapped function: setup, the restart loop, teardown."""

    def __init__(self, wrapper: Wrapper, fn: Callable, state_param: Optional[str], name: str):
        self.config = wrapper.config
        self.policy = wrapper.rank_assignment
        self.health = HealthGate(wrapper.health_check)
        self.fn, self.state_param, self.name = fn, state_param, name
        env = os.environ
        self.rank, self.world_size = dist_env.rank(env), dist_env.world_size(env)
        self.local_rank = dist_env.local_rank(env)
        self.node = node_of(env, self.rank)
        self.events = ev.EventLog.from_env(source="inprocess")
        self.saved_env = {k: env.get(k) for k in ("RANK", "WORLD_SIZE")}
        self.respawn = replacement.respawn_on(env)
        self.replacing = self.respawn and replacement.incarnation(env) > 0
        self.completed = False
        self.coord = self.abort = self.interrupter = self.monitor = self.watchdogs = None
        self.state_client, self.state_sockets = None, set()
        self.froze_gc = False

    # ---- setup / teardown --------------------------------------------------------------
    def run(self, args: Tuple, kwargs: Dict) -> Any:
        self.config.check_world(self.world_size)
        endpoint = endpoint_from_env(os.environ)
        self.endpoint = endpoint
        self.clients = StoreClients(endpoint, self.rank, self.world_size, timeout=self.config.barrier_timeout)
        prefix = f"{endpoint.key_prefix}/{self.name}"
        try:
            self.coord = Coordinator(self.clients.connect(), prefix, self.rank)
            # Every connection is opened before the barrier, where a slow one costs nothing (store.py).
            self.watchdogs = Watchdogs(self.config, self.clients, prefix, self.rank)
            self.watchdogs.connect()
            protected = endpoint.port if self.clients.server is not None else None
            self.abort = AbortProcessGroups(IterationConnections(protected), self.config.empty_cuda_cache)
            self._connect_state_client()
            if self.replacing:
                plan, self.nodes = replacement.join(self.coord, self.world_size, self.config.respawn_timeout)
                self.events.emit(ev.INPROCESS_REPLACEMENT_JOINED, iteration=plan.iteration)
            else:
                self.nodes = self.coord.initial_barrier(self.node, self.world_size, self.config.barrier_timeout)
                plan = first_plan(self.nodes, self.config)
            if self.respawn:
                replacement.announce(os.environ, self.rank)
            # Objects that exist now (modules, torch internals) are not garbage from a failed
            # iteration: keep them out of the full collection every restart runs (0.2-0.7 s).
            gc.freeze()
            self.froze_gc = True
            self.interrupter = MainThreadInterrupter(self.config.signal_number("interrupt_signal"))
            self.interrupter.install()
            self.monitor = self.watchdogs.start(self.interrupter, self.abort, self.events)
            return self._loop(plan, args, kwargs)
        except BaseException as e:
            self._leave_abnormally(e)
            raise
        finally:
            self._teardown()

    def _connect_state_client(self) -> None:
        """The client behind RestartState.store, opened ahead of the iteration that uses it.

        The iteration adopts its socket: the abort shuts it down with the iteration's own
        connections (a store wait inside init_process_group fails at once), and the restart
        path opens the next one before its barrier.
        """
        before = open_sockets()
        self.state_client = self.clients.connect()
        self.state_sockets = {s for s in open_sockets() - before if peer_port(s[0]) == self.endpoint.port}

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
        if self.watchdogs is not None:
            self.watchdogs.stop()
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
        self.state_client = None
        self.clients.close()

    # ---- the restart loop ----------------------------------------------------------------
    def _loop(self, plan: Plan, args: Tuple, kwargs: Dict) -> Any:
        while True:
            role = plan.role(self.rank)
            if role == OUT:
                self._leave_excluded(plan)
            if plan.give_up:
                self.events.emit(ev.INPROCESS_GAVE_UP, iteration=plan.iteration, reason=plan.give_up)
                logger.error("in-process restart gives up: %s", plan.give_up)
                raise InProcessGaveUp(plan.give_up)
            if plan.iteration > 0:
                self.events.emit(ev.INPROCESS_RESTARTED, iteration=plan.iteration, rank_now=plan.assignment.active[self.rank],
                                 world_size=plan.assignment.world_size, role=role)
            outcome, value = self._run_iteration(plan, role, args, kwargs)
            if outcome is _COMPLETED:
                self.completed = True
                self.events.emit(ev.INPROCESS_COMPLETED, iteration=plan.iteration, role=role)
                return value
            error, value = value, None  # _restart drops the last reference to the failed iteration's error
            plan = self._restart(plan, outcome, error)

    def _run_iteration(self, plan: Plan, role: str, args: Tuple, kwargs: Dict):
        """(_COMPLETED, return value) or (cause-or-None, exception-or-None)."""
        k = plan.iteration
        self.abort.connections.begin()
        self.abort.connections.adopt(self.state_sockets)
        self.monitor.begin_iteration(k, plan.members(), plan.marked)
        restart = replacement.wait_for_replacements(self.coord, plan, self.config.respawn_timeout)
        if restart is not None:
            return Cause.PEER_INTERRUPTED, RestartRequested(restart)
        if role != ACTIVE:
            return self._wait(plan, deadline=None)
        state = self._state(plan)
        os.environ.update(RANK=str(state.rank), WORLD_SIZE=str(state.world_size))
        if self.state_param:
            kwargs = {**kwargs, self.state_param: state}
        error: Optional[BaseException] = None
        late = self.interrupter.late_requests
        self.monitor.enter_function()
        try:
            # A request that arrives as fn returns is not raised (interruption.py); the store
            # settles how the iteration ended, the same way on every rank (_wait).
            result = self.interrupter.call(self.fn, *args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # RestartRequested included
            error = e
        finally:
            self.monitor.leave_function()
        del state, kwargs
        if error is not None:
            return None, error
        if self.interrupter.late_requests != late:
            logger.info("rank %d iteration %d: an interruption arrived as the function returned; the store settles "
                        "whether the iteration completed", self.rank, k)
        self.coord.mark_done(k)
        outcome, _ = self._wait(plan, deadline=self.config.completion_timeout)
        if outcome is _COMPLETED:
            self.abort.release()  # groups the function left behind die now, with their threads idle
        return (_COMPLETED, result) if outcome is _COMPLETED else (outcome, None)

    def _state(self, plan: Plan) -> RestartState:
        import torch.distributed as dist

        prefix = f"{self.coord.iteration_prefix(plan.iteration)}/pg"
        store = dist.PrefixStore(prefix, self.state_client)  # its socket is shut down if the iteration is aborted
        return RestartState(
            iteration=plan.iteration, rank=plan.assignment.active[self.rank], world_size=plan.assignment.world_size,
            initial_rank=self.rank, initial_world_size=self.world_size, local_rank=self.local_rank,
            store=store, store_prefix=prefix, previous_interruptions=plan.previous,
            terminated_ranks=frozenset(plan.causes), _atomic=self.interrupter.atomic,
            respawned=frozenset(plan.assignment.active[r] for r in plan.awaiting) - {None},
            _group_created=self.abort.hold_current,
            _gloo_timeout=(self.config.soft_timeout + self.config.hard_timeout) / 2,
        )

    def _wait(self, plan: Plan, deadline: Optional[float]):
        """Wait until every active rank finished the iteration, or something interrupted it.

        Either is proposed to the store, and the first proposal is how the iteration ended on
        every rank: an interruption recorded as the last rank returned would otherwise
        restart the ranks that saw it and complete the others.
        """
        k, world = plan.iteration, plan.assignment.world_size
        poller, start = Poller(), time.monotonic()
        while True:
            cause = None
            if self.coord.done_count(k) >= world:
                proposal = SETTLED_COMPLETED
            elif self.coord.interrupted(k, plan.marked):
                proposal, cause = SETTLED_RESTART, Cause.PEER_INTERRUPTED
            elif deadline is not None and time.monotonic() - start > deadline:
                waited = time.monotonic() - start
                detail = f"rank {self.rank} waited {waited:.0f} s for {world - self.coord.done_count(k)} ranks"
                self.coord.record(k, Cause.COMPLETION_TIMEOUT, detail)
                proposal, cause = SETTLED_RESTART, Cause.COMPLETION_TIMEOUT
            else:
                poller.wait()
                continue
            if self.coord.settle(k, proposal) == SETTLED_COMPLETED:
                self.monitor.end_iteration()  # nothing may abort the groups the function leaves to its caller
                return _COMPLETED, None
            return cause or Cause.PEER_INTERRUPTED, None

    def _restart(self, plan: Plan, cause: Optional[Cause], error: Optional[BaseException]) -> Plan:
        k, left_at = plan.iteration, time.monotonic()
        cause, detail = self._classify(plan, cause, error)
        self.events.emit(ev.INPROCESS_INTERRUPTED, iteration=k, cause=cause.value, detail=detail, by="main")
        self.monitor.end_iteration()
        shut = self.abort.abort_communication()
        self.abort.destroy()
        self.events.emit(ev.INPROCESS_ABORTED, iteration=k, connections_shut_down=shut, by="main")
        if error is not None:
            clear_frames(error)
            error = None
        healthy, results = self.health.run(self.events, k)
        if not healthy:
            self.coord.mark_terminated(self.rank, Cause.HEALTH_CHECK, "; ".join(r.detail for r in results))
            raise RankExcluded(f"rank {self.rank} failed its health check after iteration {k}")
        self._connect_state_client()  # the abort shut the last one down; the barrier absorbs a slow connect
        self.coord.arrive(k)
        self.coord.wait_for_members(
            k, plan.members(), plan.marked, self.config.barrier_timeout, self.config.heartbeat_timeout,
            self.config.heartbeat_interval, on_lost=lambda r: self._declare_lost(k, r))
        self._last_call(left_at)
        marks, marked = self.coord.terminations()
        winning = self.coord.propose_plan(k, self._proposal(plan, marks, marked))
        new_plan = Plan.from_json(winning, self.nodes)
        replacement.publish(self.coord, new_plan)
        self.abort.release()
        self.events.emit(ev.INPROCESS_REASSIGNED, iteration=new_plan.iteration, rank_now=new_plan.assignment.active[self.rank],
                         world_size=new_plan.assignment.world_size, out=sorted(new_plan.causes),
                         reserves=len(new_plan.assignment.reserves()))
        return new_plan

    def _last_call(self, left_at: float) -> None:
        """Wait out last_call_wait (counted from leaving the iteration) before the plan reads
        the terminations: a rank dying just after the fault (its node going down with it) is
        then left out of this plan rather than ending the next iteration at once."""
        remaining = self.config.last_call_wait - (time.monotonic() - left_at)
        if remaining > 0:
            time.sleep(remaining)

    def _proposal(self, plan: Plan, marks: Dict[int, str], marked: int) -> str:
        records = self.coord.records(plan.iteration)
        generations = replacement.generations(self.coord, marks, plan.causes) if self.respawn else None
        return next_plan(plan, records, marks, self.config, self.policy, marked, generations).to_json()

    def _classify(self, plan: Plan, cause: Optional[Cause], error: Optional[BaseException]) -> Tuple[Cause, str]:
        """Record why this rank left the iteration, unless the monitor already did."""
        k, triggered, timed_out = plan.iteration, self.monitor.triggered, self.monitor.soft_timeout_detected
        if triggered is None and timed_out is not None:
            # The monitor's soft-timeout record can end the iteration everywhere (a peer aborts, this
            # rank's collective fails) before its trigger() runs: this rank still left on its timeout.
            triggered, error = Cause.SOFT_TIMEOUT, RestartRequested(f"{Cause.SOFT_TIMEOUT.value}: {timed_out}")
        if isinstance(error, RestartRequested) or triggered is not None:
            cause = triggered or Cause.PEER_INTERRUPTED
            detail = str(error) if error is not None else "interrupted"
            if cause != Cause.SOFT_TIMEOUT or not self.monitor.soft_timeout_recorded:  # the monitor's record stands
                self.coord.record(k, cause, detail)
            return cause, detail
        if error is not None:
            detail = f"{type(error).__name__}: {error}"[:1000]
            cause = Cause.PEER_INTERRUPTED if self.coord.interrupted(k, plan.marked) else Cause.EXCEPTION
            self.coord.record(k, cause, detail)
            if cause == Cause.EXCEPTION and not is_communication_error(error):
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
        self.events.emit(ev.INPROCESS_EXCLUDED, iteration=plan.iteration, cause=cause, faults=plan.faults.get(self.rank, 0))
        if cause == Cause.MAX_RANK_FAULTS.value:
            raise InProcessGaveUp(f"rank {self.rank} caused {plan.faults.get(self.rank)} faults, more than "
                                  f"max_rank_faults={self.config.max_rank_faults}")
        raise RankExcluded(f"rank {self.rank} is out of the job ({cause})")
