"""DistributedSignalHandler in one process: installation rules, real signals, the N-step
agreement cadence, DataLoader worker policies and config validation."""

import os
import signal
import sys
import subprocess
import threading
import time

import pytest
from harness import wait_for
from nvrx_core.config import ConfigError
from nvrx_core.events import EventLog, read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.preemption import (PREEMPTION_AGREED, DistributedSignalHandler, PreemptionConfig,
                                  WorkerSignalPolicy)


def test_install_records_signals_and_release_restores_the_previous_handler():
    previous = signal.getsignal(signal.SIGUSR1)
    handler = DistributedSignalHandler(PreemptionConfig(signals=["SIGUSR1"]), process_group=None)
    with handler:
        assert handler.installed and not handler.signaled
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: handler.signaled, what="the signal recorded")
        os.kill(os.getpid(), signal.SIGUSR1)      # a second signal is only recorded
        wait_for(lambda: len(handler.received) == 2, what="both signals recorded")
        assert handler.received == [signal.SIGUSR1, signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) is previous
    handler.release()                             # idempotent
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_install_only_on_the_main_thread_and_only_once():
    handler = DistributedSignalHandler(PreemptionConfig(signals=["SIGUSR2"]), process_group=None)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_install_error(handler)))
    thread.start()
    thread.join()
    assert "main thread" in str(errors[0]) and not handler.installed
    with handler:
        with pytest.raises(RuntimeError, match="already installed"):
            handler.install()


def _install_error(handler):
    try:
        handler.install()
    except RuntimeError as e:
        return e
    return None


def test_ranks_check_only_every_n_steps_and_the_answer_sticks(tmp_path):
    events = EventLog(str(tmp_path / "events.jsonl"), rank=0)
    config = PreemptionConfig(signals=["SIGUSR1"], check_every_n_steps=10)
    with DistributedSignalHandler(config, process_group=None, events=events) as handler:
        assert not handler.should_stop(0)
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: handler.signaled, what="the signal recorded")
        assert [handler.should_stop(s) for s in range(1, 10)] == [False] * 9
        assert handler.should_stop(10)
        assert handler.should_stop(11)            # agreed once, no further checks needed
    agreed = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == PREEMPTION_AGREED]
    assert len(agreed) == 1 and agreed[0]["step"] == 10 and agreed[0]["signals_here"] == ["SIGUSR1"]


def test_exit_preempted_uses_the_preempted_exit_code():
    handler = DistributedSignalHandler(process_group=None)
    with pytest.raises(SystemExit) as exit_info:
        handler.exit_preempted()
    assert exit_info.value.code == ExitCode.PREEMPTED == 18


def test_exit_preempted_uses_the_configured_exit_code():
    handler = DistributedSignalHandler(PreemptionConfig(exit_code=143), process_group=None)
    with pytest.raises(SystemExit) as exit_info:
        handler.exit_preempted()
    assert exit_info.value.code == 143


_WORKER_POLICY_SCRIPT = r"""
import os, signal, sys, time
from torch.utils.data import DataLoader, Dataset
from nvrx_core.preemption import DistributedSignalHandler, PreemptionConfig

class Pids(Dataset):
    def __len__(self):
        return 6
    def __getitem__(self, index):
        return os.getpid()

def state(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return "gone"

policy = sys.argv[1]
config = PreemptionConfig(signals=["SIGTERM"], dataloader_workers=policy)
with DistributedSignalHandler(config, process_group=None) as handler:
    batches = iter(DataLoader(Pids(), batch_size=1, num_workers=1, worker_init_fn=handler.worker_init_fn))
    worker = int(next(batches))
    assert worker != os.getpid()
    if policy == "default":
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's hook would raise at a random later moment
    os.kill(worker, signal.SIGTERM)  # as a scheduler signalling the process group
    if policy == "ignore":
        more = [int(b) for b in batches]
        print("WORKER_SERVED", more == [worker] * 5 and state(worker) in ("Z", "gone", "S", "R"), flush=True)
    else:
        deadline = time.monotonic() + 30
        while state(worker) not in ("Z", "gone") and time.monotonic() < deadline:
            time.sleep(0.01)
        print("WORKER_DIED", state(worker) in ("Z", "gone"), flush=True)
        os._exit(0 if not handler.signaled else 3)  # the dead worker's queue would fail teardown
    print("TRAINER_SIGNALED", handler.signaled, flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["ignore", "default"])
def test_dataloader_workers_follow_the_configured_policy(policy):
    # In a child process: torch's DataLoader installs a process-wide SIGCHLD hook that raises
    # for a dead worker at arbitrary later moments, which must not leak into this test process.
    out = subprocess.run([sys.executable, "-c", _WORKER_POLICY_SCRIPT, policy], capture_output=True,
                         text=True, timeout=80)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    if policy == "ignore":
        assert "WORKER_SERVED True" in out.stdout, out.stdout  # the worker ignored SIGTERM and kept serving
    else:
        assert "WORKER_DIED True" in out.stdout, out.stdout   # default disposition: SIGTERM killed it
    if policy == "ignore":
        assert "TRAINER_SIGNALED False" in out.stdout, out.stdout  # the worker's signal never reached the trainer


def test_worker_policy_is_picklable_and_chains_the_users_init_fn():
    import pickle

    seen = []
    WorkerSignalPolicy([int(signal.SIGUSR2)], "inherit", then=seen.append)(3)
    assert seen == [3]
    plain = DistributedSignalHandler(process_group=None).worker_init_fn
    assert pickle.loads(pickle.dumps(plain)) == plain


@pytest.mark.parametrize("overrides,match", [
    ({"signals": ["SIGKILL"]}, "signals='SIGKILL': cannot be caught"),
    ({"signals": ["SIGNOPE"]}, "signals='SIGNOPE': is not a signal name"),
    ({"signals": []}, "signals=\\[\\]: must be a non-empty list"),
    ({"check_every_n_steps": 0}, "check_every_n_steps=0: must be an integer >= 1"),
    ({"dataloader_workers": "kill"}, "dataloader_workers='kill': must be one of"),
    ({"exit_code": 0}, "exit_code=0: must be an integer in 1..255"),
    ({"exit_code": 256}, "exit_code=256: must be an integer in 1..255"),
    ({"exit_code": "18"}, "exit_code='18': must be an integer"),
])
def test_config_errors_name_field_value_and_rule(overrides, match):
    with pytest.raises(ConfigError, match=match):
        PreemptionConfig(**overrides)


def test_config_takes_every_spelling_of_a_signal_and_keeps_names():
    config = PreemptionConfig(signals=["TERM", "usr1", 12, signal.SIGHUP])   # "TERM" was refused
    assert config.signals == ["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP"]
    assert config.signal_numbers() == [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP]
    with pytest.raises(ConfigError, match="signals='kill': cannot be caught"):
        PreemptionConfig(signals=["kill"])


def test_config_from_yaml(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("trainer:\n  preemption:\n    signals: [SIGUSR1, SIGTERM]\n"
                    "    check_every_n_steps: 4\n")
    config = PreemptionConfig.from_sources(str(path), {"dataloader_workers": "default"})
    assert config.signals == ["SIGUSR1", "SIGTERM"] and config.check_every_n_steps == 4
    assert config.dataloader_workers == "default"
