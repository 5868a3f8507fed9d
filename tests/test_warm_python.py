"""The warm-python helper behaves like `python script.py` where the tests depend on it: exit
codes (SystemExit, an uncaught exception, a signal), atexit handlers and non-daemon threads at
exit, sys.argv, __name__, sys.path (PYTHONPATH too), environment, working directory, streams, a new
session, OMP_NUM_THREADS; and each child is a process of its own."""

import os
import signal
import subprocess
import textwrap

import pytest

from harness import wait_for
import warm_python

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, threading, time
    import torch
    mode = sys.argv[1]
    if mode == "report":
        print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
                          "env": os.environ.get("WARM_TEST"), "path1": sys.path[1], "pid": os.getpid(), "sid": os.getsid(0),
                          "threads": torch.get_num_threads()}))
    elif mode == "exit":
        sys.exit(int(sys.argv[2]))
    elif mode == "raise":
        raise ValueError("boom")
    elif mode == "at_exit":
        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished", flush=True))).start()
    elif mode == "sleep":
        print("sleeping", flush=True)
        time.sleep(300)
    elif mode == "stdin":
        print(sys.stdin.readline().strip().upper())
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(SCRIPT)
    return str(path)


def run(argv, **kw):
    proc = warm_python.popen(argv, stdout=warm_python.PIPE, stderr=warm_python.PIPE, text=True, **kw)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_a_child_sees_what_a_new_interpreter_would(script, tmp_path):
    import json

    code, out, _ = run([script, "report", "x"], cwd=str(tmp_path),
                       env=dict(os.environ, WARM_TEST="yes", OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path)))
    seen = json.loads(out)
    assert code == 0
    assert seen["argv"] == [script, "report", "x"] and seen["name"] == "__main__"
    assert seen["path0"] == os.path.dirname(script) and seen["cwd"] == str(tmp_path)
    assert seen["env"] == "yes" and seen["threads"] == 1 and seen["path1"] == str(tmp_path)
    assert seen["pid"] != os.getpid() and seen["sid"] == os.getsid(0)


def test_exit_codes_are_those_of_python(script):
    assert run([script, "exit", "7"])[0] == 7
    code, _, err = run([script, "raise"])
    assert code == 1 and "ValueError: boom" in err and "Traceback" in err


def test_atexit_handlers_and_non_daemon_threads_run_at_exit(script):
    code, out, _ = run([script, "at_exit"])
    assert code == 0 and out.splitlines() == ["thread finished", "atexit ran"]


def test_a_signal_ends_it_as_popen_reports_it_and_a_new_session_is_its_own(script):
    proc = warm_python.popen([script, "sleep"], stdout=warm_python.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "sleeping"
    assert os.getsid(proc.pid) == proc.pid
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM
    assert proc.poll() == -signal.SIGTERM


def test_stdin_and_a_module_run_with_minus_m(script, tmp_path):
    proc = warm_python.popen([script, "stdin"], stdin=warm_python.PIPE, stdout=warm_python.PIPE, text=True)
    proc.stdin.write("hello\n")
    proc.stdin.close()
    assert proc.stdout.read().strip() == "HELLO" and proc.wait(60) == 0
    (tmp_path / "warm_mod.py").write_text("import sys; print(__name__, sys.argv[1:])")
    code, out, _ = run(["-m", "warm_mod", "a"], cwd=str(tmp_path))
    assert (code, out.strip()) == (0, "__main__ ['a']")


def test_children_are_separate_processes_that_can_run_at_once(script):
    procs = [warm_python.popen([script, "sleep"], stdout=warm_python.PIPE, text=True) for _ in range(3)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["sleeping"] * 3
        assert len({p.pid for p in procs}) == 3
        procs[1].kill()
        assert procs[1].wait(60) == -signal.SIGKILL
        assert procs[0].poll() is None and procs[2].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait(60)
    wait_for(lambda: all(not os.path.exists(f"/proc/{p.pid}") for p in procs), 30, "children reaped")
