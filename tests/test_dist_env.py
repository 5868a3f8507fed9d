"""nvrx_core.dist_env: one rule for RANK / LOCAL_RANK / WORLD_SIZE ... from the environment.

Unset means a single process; a value that is set but wrong is refused with the variable and
the value named, never defaulted (two processes that both took rank 0 fail far from the cause).
"""

import subprocess
import sys

import pytest

from nvrx_core import dist_env
from nvrx_core.config import ConfigError

READERS = [
    (dist_env.rank, "RANK", 0),
    (dist_env.local_rank, "LOCAL_RANK", 0),
    (dist_env.world_size, "WORLD_SIZE", 1),
    (dist_env.local_world_size, "LOCAL_WORLD_SIZE", 1),
    (dist_env.restart_count, "TORCHELASTIC_RESTART_COUNT", 0),
]


@pytest.mark.parametrize("read, name, alone", READERS)
def test_unset_means_a_single_process_and_optional_says_none(read, name, alone):
    assert read({}) == alone
    assert read({}, optional=True) is None


def test_a_launchers_worker_reads_its_values():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "TORCHELASTIC_RESTART_COUNT": "2"}
    assert (dist_env.rank(env), dist_env.world_size(env), dist_env.local_rank(env),
            dist_env.local_world_size(env), dist_env.restart_count(env)) == (5, 8, 1, 4, 2)
    assert dist_env.rank(env, optional=True) == 5


def test_the_default_mapping_is_the_process_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert dist_env.rank() == 3
    monkeypatch.delenv("RANK")
    assert dist_env.rank() == 0


@pytest.mark.parametrize("read, name, alone", READERS)
@pytest.mark.parametrize("value", ["", "zero", "1.0", "0x1"])
def test_a_value_that_is_not_an_integer_is_refused_naming_it(read, name, alone, value):
    for optional in (False, True):
        with pytest.raises(ConfigError, match=rf"{name}={value!r}: must be an integer"):
            read({name: value}, optional=optional)


@pytest.mark.parametrize("read, name, least", [
    (dist_env.rank, "RANK", 0),
    (dist_env.local_rank, "LOCAL_RANK", 0),
    (dist_env.restart_count, "TORCHELASTIC_RESTART_COUNT", 0),
    (dist_env.world_size, "WORLD_SIZE", 1),
    (dist_env.local_world_size, "LOCAL_WORLD_SIZE", 1),
])
def test_a_negative_rank_or_an_empty_world_is_refused(read, name, least):
    with pytest.raises(ConfigError, match=rf"{name}='{least - 1}': must be >= {least}"):
        read({name: str(least - 1)})
    assert read({name: str(least)}) == least


@pytest.mark.parametrize("read, rank_name, size_name", [
    (dist_env.rank, "RANK", "WORLD_SIZE"),
    (dist_env.local_rank, "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
])
def test_a_rank_at_or_above_its_world_size_is_refused(read, rank_name, size_name):
    for rank in ("4", "9"):
        with pytest.raises(ConfigError, match=rf"{rank_name}={rank}: must be below {size_name}=4"):
            read({rank_name: rank, size_name: "4"})
    assert read({rank_name: "3", size_name: "4"}) == 3
    # the size alone cannot be checked against an unset rank; a set rank checks the size too
    assert read({size_name: "4"}) == 0
    with pytest.raises(ConfigError, match=rf"{size_name}='x'"):
        read({rank_name: "0", size_name: "x"})


def test_a_rank_without_its_world_size_is_taken_as_given():
    """Some launchers set LOCAL_RANK alone: a bound is checked only where the size is known."""
    assert dist_env.local_rank({"LOCAL_RANK": "3"}) == 3
    assert dist_env.rank({"RANK": "7"}) == 7


def test_the_event_log_of_a_process_outside_a_launcher_has_no_rank(monkeypatch):
    from nvrx_core.events import EventLog

    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    log = EventLog.from_env(source="test")
    assert (log.rank, log.cycle) == (None, None)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    log = EventLog.from_env(source="test")
    assert (log.rank, log.cycle) == (2, 1)
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(ConfigError, match="RANK='two'"):
        EventLog.from_env(source="test")


def test_a_fault_injector_refuses_a_bad_rank_instead_of_firing_in_rank_0(monkeypatch):
    from nvrx_core.ft.faults import FaultInjector, SimulatedFault

    fault = SimulatedFault(fault_type="rank_killed", rank_to_fail=0, at_iteration=3)
    monkeypatch.setenv("RANK", "-1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="RANK='-1': must be >= 0"):
        FaultInjector(fault)
    monkeypatch.setenv("RANK", "1")
    assert not FaultInjector(fault).armed


def test_the_module_and_the_event_log_import_no_torch():
    code = ("import sys, nvrx_core.dist_env, nvrx_core.events; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
