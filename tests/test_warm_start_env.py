"""Warm start's environment hand-over and early start, as pure functions (the launches that
depend on them are in test_ft_warm_start.py and every ft_launcher test)."""

import os
import subprocess
import sys

from nvrx_core.ft.warm_start import PRELOAD, apply_launcher_environment, early_preload, environment_changes


def test_what_the_launcher_changed_after_the_server_started_is_found():
    before = {"PATH": "/bin", "KEPT": "1", "DROPPED": "x", "CHANGED": "a"}
    now = {"PATH": "/bin", "KEPT": "1", "CHANGED": "b", "ADDED": "socket"}
    assert environment_changes(before, now) == {"DROPPED": ["x", None], "CHANGED": ["a", "b"],
                                                "ADDED": [None, "socket"]}


def test_a_worker_applies_the_changes_except_what_torch_set_for_it(monkeypatch):
    monkeypatch.setenv("DROPPED", "x")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")      # torch set this worker's own value
    monkeypatch.delenv("ADDED", raising=False)
    apply_launcher_environment({"DROPPED": ["x", None], "ADDED": [None, "socket"], "OMP_NUM_THREADS": [None, "1"]})
    assert "DROPPED" not in os.environ and os.environ["ADDED"] == "socket"
    assert os.environ["OMP_NUM_THREADS"] == "4"


def test_the_command_line_decides_the_early_start():
    assert early_preload(["--nproc-per-node", "2", "train.py"]) == list(PRELOAD)
    assert early_preload(["--warm-start-preload", "lightning.pytorch, nvrx_lightning", "t.py"]) == \
        [*PRELOAD, "lightning.pytorch", "nvrx_lightning"]
    assert early_preload(["--warm-start-preload=a,b", "t.py"]) == [*PRELOAD, "a", "b"]
    for no in (["--no-warm-start", "t.py"], ["--no-python", "run.sh"], ["--help"]):
        assert early_preload(no) is None


def test_the_command_module_imports_no_torch():
    """The fork server's `import torch` overlaps the launcher's only if the command's own
    imports (nvrx_core.ft's package, the client it exports) leave torch alone."""
    code = "import sys, nvrx_core.ft.command; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_fork_server_ignores_stop_signals_from_its_first_import_and_nothing_else_does():
    """fork_server_signals acts only inside multiprocessing's fork server (the job-wide SIGTERM
    it survives is tested in test_preemption_step_signal.py); imported anywhere else it is inert."""
    assert PRELOAD[0] == "nvrx_core.ft.fork_server_signals"
    code = ("import signal, nvrx_core.ft.fork_server_signals as f; "
            "print(f.imported_by_fork_server(), signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]
