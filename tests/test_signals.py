"""nvrx_core.signals: one owner per signal, real signals delivered to this process.

Each test uses its own SignalRegistry (not the process's default), and every claim is
released in a finally block, so the pytest process's dispositions are left as found.
"""

import faulthandler
import os
import signal
import subprocess
import sys
import threading

import pytest

from nvrx_core.config import ConfigError
from nvrx_core.signals import (FaultHandlerDump, SignalClaimError, SignalRegistry, default_registry,
                                parse_signal)


def _deliver(signum):
    """Send `signum` to the main thread; pthread_kill runs the Python handler before returning."""
    signal.pthread_kill(threading.main_thread().ident, signum)


def test_claim_installs_the_handler_and_release_restores_the_previous_one():
    registry, seen = SignalRegistry(), []
    previous = signal.getsignal(signal.SIGUSR1)
    claim = registry.claim(signal.SIGUSR1, "tester", lambda n, f: seen.append(n))
    try:
        assert registry.owner(signal.SIGUSR1) == "tester" and claim.held
        _deliver(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
    finally:
        claim.release()
    assert signal.getsignal(signal.SIGUSR1) is previous and not claim.held
    assert registry.owner(signal.SIGUSR1) is None and registry.owners() == {}
    claim.release()  # idempotent
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_a_conflicting_claim_is_refused_naming_both_owners_and_the_signal():
    registry = SignalRegistry()
    first = registry.claim(signal.SIGTERM, "preemption", lambda n, f: None)
    try:
        with pytest.raises(SignalClaimError) as refused:
            registry.claim(signal.SIGTERM, "inprocess.interrupt", lambda n, f: None)
        message = str(refused.value)
        assert "SIGTERM" in message and "preemption" in message and "inprocess.interrupt" in message
        # a stack dump does not share with a Python handler either
        with pytest.raises(SignalClaimError, match="held by preemption"):
            registry.claim(signal.SIGTERM, "ft.client", FaultHandlerDump())
        with pytest.raises(SignalClaimError, match="already holds SIGTERM"):
            registry.claim(signal.SIGTERM, "preemption", lambda n, f: None)
        assert registry.owner(signal.SIGTERM) == "preemption"
        assert signal.getsignal(signal.SIGTERM) is first.action  # the refused claims changed nothing
    finally:
        first.release()


def test_replace_changes_the_action_but_release_still_restores_the_original():
    registry, seen = SignalRegistry(), []
    previous = signal.getsignal(signal.SIGUSR2)
    claim = registry.claim(signal.SIGUSR2, "owner", lambda n, f: seen.append("old"))
    newer = registry.claim(signal.SIGUSR2, "owner", lambda n, f: seen.append("new"), replace=True)
    try:
        assert not claim.held and newer.held
        _deliver(signal.SIGUSR2)
        assert seen == ["new"]
    finally:
        newer.release()
    assert signal.getsignal(signal.SIGUSR2) is previous


def test_claims_off_the_main_thread_are_refused_clearly():
    registry, errors = SignalRegistry(), []

    def claim_in_thread():
        try:
            registry.claim(signal.SIGUSR1, "worker-thread", lambda n, f: None)
        except SignalClaimError as e:
            errors.append(str(e))

    thread = threading.Thread(target=claim_in_thread, name="helper")
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in errors[0] and "'helper'" in errors[0]
    assert "worker-thread" in errors[0] and "SIGUSR1" in errors[0]
    assert registry.owner(signal.SIGUSR1) is None


def test_stack_dumps_may_be_claimed_from_any_thread(tmp_path):
    """faulthandler installs from C; only Python handlers are tied to the main thread."""
    registry, claims, errors = SignalRegistry(), [], []
    with open(tmp_path / "dump.txt", "w") as dump:
        def claim_in_thread():
            try:
                claims.append(registry.claim(signal.SIGUSR2, "ft.client", FaultHandlerDump(dump)))
            except SignalClaimError as e:
                errors.append(e)

        thread = threading.Thread(target=claim_in_thread)
        thread.start()
        thread.join()
        assert errors == [] and registry.owner(signal.SIGUSR2) == "ft.client"
        claims[0].release()
    assert faulthandler.unregister(signal.SIGUSR2) is False  # nothing left registered


def test_replacing_a_handler_by_a_dump_then_releasing_restores_the_outside_handler(tmp_path):
    registry, seen = SignalRegistry(), []
    original = signal.signal(signal.SIGUSR1, lambda n, f: seen.append("outside"))
    try:
        registry.claim(signal.SIGUSR1, "owner", lambda n, f: seen.append("claimed"))
        with open(tmp_path / "dump.txt", "w") as dump:
            claim = registry.claim(signal.SIGUSR1, "owner", FaultHandlerDump(dump), replace=True)
            _deliver(signal.SIGUSR1)  # dumped, no Python handler runs
            claim.release()
        _deliver(signal.SIGUSR1)
        assert seen == ["outside"]
        assert "Current thread" in (tmp_path / "dump.txt").read_text()
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_bad_actions_and_owners_are_refused_before_anything_changes():
    registry = SignalRegistry()
    with pytest.raises(TypeError, match="callable, SIG_IGN, SIG_DFL or FaultHandlerDump"):
        registry.claim(signal.SIGUSR1, "owner", "not a handler")
    with pytest.raises(ValueError, match="owner name"):
        registry.claim(signal.SIGUSR1, "", signal.SIG_IGN)
    assert registry.owners() == {}


_DUMP_SCRIPT = r"""
import os, signal, sys
from nvrx_core.signals import FaultHandlerDump, SignalClaimError, default_registry

def deliver():  # faulthandler writes from C, in the signal handler, before kill returns
    os.kill(os.getpid(), signal.SIGUSR2)

wrapper_file, client_file = open(sys.argv[1], "w"), open(sys.argv[2], "w")
registry = default_registry()
wrapper = registry.claim(signal.SIGUSR2, "inprocess.wrapper", FaultHandlerDump(wrapper_file))
client = registry.claim(signal.SIGUSR2, "ft.client", FaultHandlerDump(client_file))  # dumps share
print("OWNERS", registry.owners()["SIGUSR2"], flush=True)
try:
    registry.claim(signal.SIGUSR2, "preemption", lambda n, f: None)
except SignalClaimError as e:
    print("REFUSED", "ft.client" in str(e), flush=True)
deliver()                       # the newest dump claim (the client's file) is used
client.release()
deliver()                       # the wrapper's dump is back
wrapper.release()
print("DEFAULT", signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL, flush=True)
ignored = registry.claim(signal.SIGUSR2, "test", signal.SIG_IGN)
os.kill(os.getpid(), signal.SIGUSR2)
ignored.release()
print("IGNORED", flush=True)
os.kill(os.getpid(), signal.SIGUSR2)  # default disposition again: this kills the process
print("SURVIVED", flush=True)
"""


def test_stack_dump_claims_share_a_signal_and_release_restores_the_default(tmp_path):
    wrapper_file, client_file = tmp_path / "wrapper.txt", tmp_path / "client.txt"
    out = subprocess.run([sys.executable, "-c", _DUMP_SCRIPT, str(wrapper_file), str(client_file)],
                         capture_output=True, text=True, timeout=60)
    assert "OWNERS ['inprocess.wrapper', 'ft.client']" in out.stdout, out.stdout + out.stderr
    assert "REFUSED True" in out.stdout and "DEFAULT True" in out.stdout and "IGNORED" in out.stdout
    assert "SURVIVED" not in out.stdout and out.returncode == -signal.SIGUSR2  # the default disposition killed it
    assert client_file.read_text().count("Current thread") == 1
    assert wrapper_file.read_text().count("Current thread") == 1


def test_the_default_registry_is_per_process():
    registry = default_registry()
    assert default_registry() is registry
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked child starts with its own, empty registry
        os.write(write, b"1" if default_registry() is not registry and not default_registry().owners() else b"0")
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def test_a_released_stack_dump_leaves_faulthandler_unregistered():
    registry = SignalRegistry()
    claim = registry.claim(signal.SIGUSR1, "dumper", FaultHandlerDump())
    claim.release()
    # unregistering again reports that nothing is registered for the signal any more
    assert faulthandler.unregister(signal.SIGUSR1) is False


@pytest.mark.parametrize("value, expected", [
    (signal.SIGTERM, signal.SIGTERM), (15, signal.SIGTERM), ("15", signal.SIGTERM), ("SIGTERM", signal.SIGTERM),
    ("TERM", signal.SIGTERM), ("sigterm", signal.SIGTERM), ("term", signal.SIGTERM), (" SIGUSR1 ", signal.SIGUSR1),
    ("KILL", signal.SIGKILL),           # whether a signal suits its use is the caller's rule
    ("SIGNOPE", None), ("NOPE", None), (100000, None), (-1, None), ("-1", None), ("", None), ("SIG", None),
    ("SIG_DFL", None), (True, None), (1.5, None), (None, None), (["SIGTERM"], None),
])
def test_parse_signal_is_the_one_rule(value, expected):
    """Every config and adapter reads a signal by this rule; anything else is refused naming the
    field and the value."""
    if expected is not None:
        assert parse_signal(value, "field") is expected
    else:
        with pytest.raises(ConfigError, match=r"^some\.field=.*: is not a signal name or number"):
            parse_signal(value, "some.field")
