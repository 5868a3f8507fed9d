"""Megatron-Bridge's in-process restart entry points, on nvrx_core.inprocess.Wrapper.

    wrapped, store = maybe_wrap_for_inprocess_restart(_pretrain, cfg.inprocess_restart, state)
    wrapped(state, forward_step_func, store=store)   # Bridge's pretrain() calls it this way

Bridge's contract, kept: `maybe_wrap_for_inprocess_restart` returns `(train_fn, None)` when
`enabled` is False, else the wrapped function and a store; the wrapped function calls
`train_fn(*args, inprocess_call_wrapper=<object with .iteration>, **kwargs)`, and the training
function builds its process group on `PrefixStore(str(iteration), store)`. After a fault,
every healthy rank tears down the process groups and calls the function again, in the same
process; `global_state` is cleaned first (its async checkpoint queue aborted, then
`reset_for_restart()`), as Bridge's finalize does.

Where this differs from Bridge, on purpose:
- every field of InProcessRestartConfig takes effect, `max_iterations` included (Bridge
  declares it and never uses it): the function is called at most that many times, then every
  rank raises InProcessGaveUp (SystemExit 22);
- granularity "node" groups ranks by the launcher's node rank, else by blocks of
  LOCAL_WORLD_SIZE consecutive ranks, not by torch.cuda.device_count() (0 on a CPU job);
- the store is not a second TCPStore on MASTER_PORT + 1: the core's coordination store
  already owns that port when rank 0 hosts it. The returned store stands for "this
  iteration's namespace of the coordination store": passed back as `store=`, the wrapped
  function hands the training function the iteration's own store (whose connection the
  abort shuts down, so a rank waiting in process-group creation is released); used
  directly inside the function, it forwards to that namespace;
- `inprocess_call_wrapper` is the core's RestartState: `.iteration`, `.atomic()` (NVRx's
  CallWrapper.atomic), plus `.rank`, `.world_size`, `.previous_interruptions`.

Bridge's active_world_size means "exactly this many ranks train": when too few ranks are
left to fill it, it gives up; so min_active_world_size = active_world_size is passed to the
core. Health checks after a fault: this rank's GPU, NVLink and CUDA (10 s, as Bridge), each
"not applicable" on a CPU machine.
"""

import datetime
import logging
from typing import Any, Callable, Optional, Tuple

import torch.distributed as dist

from nvrx_core.health import rank_health_checks
from nvrx_core.inprocess import InProcessConfig, RestartState, Wrapper
from nvrx_megatron import convert

logger = logging.getLogger("nvrx.megatron.inprocess")

CUDA_CHECK_TIMEOUT = 10.0
"""Seconds the CUDA health check may take after a fault (Bridge's CudaHealthCheck timeout)."""


def core_config(config: Any, **overrides: Any) -> InProcessConfig:
    """The core's InProcessConfig for any object with Bridge's InProcessRestartConfig fields,
    every field applied; errors name Bridge's fields. `overrides` use the core's names."""
    active = convert.bridge_fields(config, "InProcessRestartConfig")["active_world_size"]
    if active is not None:
        overrides.setdefault("min_active_world_size", active)  # Bridge: exactly this many train
    return convert.inprocess_config(config, **overrides)


def inprocess_restart(train_fn: Callable, config: Any, global_state: Any) -> Callable:
    """`train_fn` wrapped for in-process restart (Bridge wraps whatever `config.enabled` says).

    `global_state` is duck-typed like Bridge's GlobalState: `async_calls_queue` (closed with
    abort=True) and `reset_for_restart()` are used before each restarted call when present.
    """
    return _wrap(train_fn, config, global_state, None)


def maybe_wrap_for_inprocess_restart(train_fn: Callable, config: Any, state: Any
                                     ) -> Tuple[Callable, Optional[dist.Store]]:
    """(train_fn, None) when `config.enabled` is False (or config is None); else (wrapped
    train_fn, restart store). `config`: any object with Bridge's InProcessRestartConfig fields.

    Pass the store back as `store=` when calling the wrapped function (Bridge's pretrain does).
    """
    if config is None:
        return train_fn, None
    enabled = convert.bridge_fields(config, "InProcessRestartConfig")["enabled"]
    if not isinstance(enabled, bool):  # a string "false" is truthy: it must not switch restarts on
        core_config(config)            # raises, naming the field
    if not enabled:
        return train_fn, None
    store = RestartStore()
    return _wrap(train_fn, config, state, store), store


def _wrap(train_fn: Callable, config: Any, global_state: Any, store: Optional["RestartStore"]) -> Callable:
    settings = core_config(config, enabled=True)  # Bridge wraps whatever `enabled` says

    def call(*args: Any, _nvrx_restart_state: RestartState, **kwargs: Any) -> Any:
        state = _nvrx_restart_state
        if state.iteration > 0:
            _reset_for_restart(global_state)
        kwargs.pop("inprocess_call_wrapper", None)
        if store is None:
            return train_fn(*args, inprocess_call_wrapper=state, **kwargs)
        if kwargs.get("store") is store:  # the iteration's own connection: the abort releases waits on it
            kwargs["store"] = state.store
        store.current = state.store
        try:
            return train_fn(*args, inprocess_call_wrapper=state, **kwargs)
        finally:
            store.current = None

    # The Wrapper names its store keys after the function: every rank must derive the same name.
    call.__module__ = getattr(train_fn, "__module__", None) or __name__
    call.__qualname__ = getattr(train_fn, "__qualname__", None) or type(train_fn).__qualname__
    call.__name__ = getattr(train_fn, "__name__", call.__qualname__)
    call.__doc__ = getattr(train_fn, "__doc__", None)
    wrapper = Wrapper(settings, health_check=rank_health_checks(cuda_timeout=CUDA_CHECK_TIMEOUT))
    return wrapper(call)


class RestartStore(dist.Store):
    """The store maybe_wrap_for_inprocess_restart returns: the running iteration's store namespace.

    Outside the wrapped function there is no iteration, so there is nothing to forward to:
    a request then raises, rather than writing keys no iteration will read.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current: Optional[dist.Store] = None

    def _target(self) -> dist.Store:
        if self.current is None:
            raise RuntimeError("the in-process restart store is usable only inside the wrapped training function "
                               "(each restart iteration has a namespace of its own)")
        return self.current

    def set(self, key, value):
        return self._target().set(key, value)

    def get(self, key):
        return self._target().get(key)

    def add(self, key, amount):
        return self._target().add(key, amount)

    def compare_set(self, key, expected, desired):
        return self._target().compare_set(key, expected, desired)

    def check(self, keys):
        return self._target().check(keys)

    def wait(self, keys, timeout: Optional[datetime.timedelta] = None):
        return self._target().wait(keys) if timeout is None else self._target().wait(keys, timeout)

    def delete_key(self, key):
        return self._target().delete_key(key)

    def num_keys(self):
        return self._target().num_keys()

    def set_timeout(self, timeout):
        return self._target().set_timeout(timeout)


def _reset_for_restart(global_state: Any) -> None:
    """Bridge's finalize after a fault: abort async checkpoint workers, reset the loop's state.

    Failures are logged, not raised: the restart goes on, as in Bridge.
    """
    if global_state is None:
        return
    queue = getattr(global_state, "async_calls_queue", None)
    if queue is not None:
        try:
            queue.close(abort=True)
        except Exception:
            logger.exception("aborting the async checkpoint queue before the restart failed")
    reset = getattr(global_state, "reset_for_restart", None)
    if callable(reset):
        try:
            reset()
        except Exception:
            logger.exception("global_state.reset_for_restart() failed")


__all__ = ["RestartStore", "core_config", "inprocess_restart", "maybe_wrap_for_inprocess_restart"]
