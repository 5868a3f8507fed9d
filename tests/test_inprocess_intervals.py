"""The Wrapper's monitor-process and progress periods, last_call_wait, and the node of a rank.

These knobs exist so nvidia-resiliency-ext's and Megatron-Bridge's settings of the same name
reach the core (nvrx_megatron passes them through); unset, the core behaves as before.
"""

import datetime
import types

import pytest

from nvrx_core.config import ConfigError
from nvrx_core.inprocess import InProcessConfig
from nvrx_core.inprocess import watchdogs as watchdogs_module
from nvrx_core.inprocess.rank_assignment import node_of
from nvrx_core.inprocess import wrapper as wrapper_module
from nvrx_core.inprocess.wrapper import _Call
from harness.clock import FakeClock


def test_unset_periods_keep_the_core_defaults():
    config = InProcessConfig(monitor_interval=0.2)
    unset = (config.monitor_process_interval, config.progress_watchdog_interval, config.last_call_wait)
    assert unset == (None, None, 0)
    assert config.monitor_process_period == config.progress_period == 0.2
    assert InProcessConfig().monitor_process_period == 0.5  # min(monitor_interval=1, 0.5), as before


def test_set_periods_are_used_and_timedeltas_accepted():
    config = InProcessConfig(monitor_process_interval=datetime.timedelta(seconds=2), progress_watchdog_interval=0.3,
                             last_call_wait=datetime.timedelta(milliseconds=250))
    assert (config.monitor_process_period, config.progress_period, config.last_call_wait) == (2.0, 0.3, 0.25)


@pytest.mark.parametrize("overrides, message", [
    ({"monitor_process_interval": 0}, "monitor_process_interval=0: must be > 0"),
    ({"progress_watchdog_interval": -1}, "progress_watchdog_interval=-1: must be > 0"),
    ({"progress_watchdog_interval": "fast"}, "progress_watchdog_interval='fast': must be a number"),
    ({"progress_watchdog_interval": 60}, r"progress_watchdog_interval=60: must be < soft_timeout \(60"),
    ({"monitor_process_interval": 60}, r"monitor_process_interval=60: must be < soft_timeout"),
    ({"monitor_process_interval": 40, "soft_timeout": 50}, r"must be < heartbeat_timeout \(30"),
    ({"last_call_wait": -0.1}, "last_call_wait=-0.1: >= 0"),
    ({"last_call_wait": 120}, r"last_call_wait=120: must be < barrier_timeout \(120"),
])
def test_bad_periods_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        InProcessConfig(**overrides)


def test_watchdogs_run_at_the_configured_periods(monkeypatch):
    """The monitor process polls at monitor_process_interval; progress is sampled at progress_watchdog_interval."""
    seen = {}

    class FakeProcess:
        def __init__(self, settings, declare):
            seen["process_interval"] = settings.interval

        def start(self):
            pass

    class FakeThread:
        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            pass

    class FakeReporter(FakeThread):
        def __init__(self, progress, process, in_function, interval, machinery_allowance):
            seen["progress_interval"] = interval

    monkeypatch.setattr(watchdogs_module, "MonitorProcess", FakeProcess)
    monkeypatch.setattr(watchdogs_module, "MonitorThread", FakeThread)
    monkeypatch.setattr(watchdogs_module, "ProgressReporter", FakeReporter)
    clients = types.SimpleNamespace(bounded=lambda timeout, name: None)
    config = InProcessConfig(monitor_process_interval=0.7, progress_watchdog_interval=0.05, stack_dump_signal=None)
    watchdogs_module.Watchdogs(config, clients, "p", 0).start(None, None, None)
    assert seen == {"process_interval": 0.7, "progress_interval": 0.05}


@pytest.fixture
def sleeps(monkeypatch):
    """The Wrapper's time on a FakeClock: the sleeps it asks for, recorded (and the clock moved
    by them) instead of slept, so what is judged is how long it waits, not how long a loaded
    host took to wake it."""
    clock, asked = FakeClock(), []

    def sleep(seconds):
        asked.append(seconds)
        clock.advance(seconds)

    monkeypatch.setattr(wrapper_module, "time", types.SimpleNamespace(monotonic=clock, sleep=sleep))
    return clock, asked


def _last_call(wait, left_s_ago, sleeps):
    """What _last_call slept, left `left_s_ago` s after leaving the iteration; _restart reads
    the terminations for its plan right after it returns."""
    clock, asked = sleeps
    call = types.SimpleNamespace(config=InProcessConfig(last_call_wait=wait))
    _Call._last_call(call, clock.now - left_s_ago)
    return sum(asked)


def test_last_call_wait_zero_plans_at_once(sleeps):
    assert _last_call(0, 0.0, sleeps) == 0


def test_last_call_wait_waits_before_the_plan_reads_the_terminations(sleeps):
    assert _last_call(0.3, 0.0, sleeps) == pytest.approx(0.3)


def test_last_call_wait_counts_from_leaving_the_iteration(sleeps):
    """Time already spent at the barrier counts: a restart is not delayed twice."""
    assert _last_call(5.0, 3.5, sleeps) == pytest.approx(1.5)


def test_last_call_wait_already_spent_at_the_barrier_waits_no_more(sleeps):
    assert _last_call(5.0, 10.0, sleeps) == 0


@pytest.mark.parametrize("env, rank, node", [
    ({"GROUP_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, 1, "3"),  # the launcher's node rank wins
    ({"LOCAL_WORLD_SIZE": "2"}, 0, "ranks-0+2"),
    ({"LOCAL_WORLD_SIZE": "2"}, 1, "ranks-0+2"),
    ({"LOCAL_WORLD_SIZE": "2"}, 2, "ranks-2+2"),
    ({"LOCAL_WORLD_SIZE": "4"}, 7, "ranks-4+4"),
])
def test_node_of_a_rank(env, rank, node):
    assert node_of(env, rank) == node


def test_node_of_falls_back_to_the_host_name(monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "host-a")
    assert node_of({}, 5) == "host-a"


@pytest.mark.parametrize("value", ["0", "two", ""])
def test_node_of_refuses_a_bad_local_world_size(value):
    with pytest.raises(ConfigError, match=f"LOCAL_WORLD_SIZE={value!r}"):
        node_of({"LOCAL_WORLD_SIZE": value}, 5)
