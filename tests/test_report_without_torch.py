"""`nvrx report` in an interpreter where `import torch` fails.

The report is read where the run's events file ends up: a laptop, a login node, a CI job that
has no torch and should not need one. These tests run a fresh interpreter whose import system
refuses torch (a meta path finder inserted before anything else is imported, answering as a
venv without torch would), and there import `nvrx_core.report` and run the `nvrx` entry point
declared in pyproject.toml on the committed example, examples/events/kill_and_hang.jsonl
(a real 2-rank run under ft_launcher with a rank killed and a rank hung; its README says which
command wrote it). Whatever on the way imports torch makes them fail, naming the import.
"""

import json
import os
import subprocess
import sys
import tomllib

from nvrx_core.report.build import build_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "events", "kill_and_hang.jsonl")

REFUSE_TORCH = '''
import sys


class RefuseTorch:
    """Answers `import torch` (and any torch.*) as an interpreter without torch installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (refused: this test runs without torch)",
                                      name=name)
        return None


sys.meta_path.insert(0, RefuseTorch())
'''

PROVE_REFUSED = '''
try:
    import torch
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the finder did not refuse torch: the test would prove nothing")
'''


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter that refuses torch, from the repository root (the test's
    own sys.path entries are not passed on: nothing of tests/ may be needed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", REFUSE_TORCH + code + PROVE_REFUSED], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def nvrx_entry_point() -> str:
    """The `nvrx` console script as pyproject.toml declares it ("module:function")."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]["nvrx"]


def test_the_report_package_imports_without_torch():
    proc = run_without_torch(
        "import json, sys\n"
        "import nvrx_core.report, nvrx_core.report.build, nvrx_core.report.text, nvrx_core.cli\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'nvrx_core'))))\n")
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert "nvrx_core.report.build" in loaded and not [m for m in loaded if m.split(".")[0] == "torch"]


def test_nvrx_report_on_the_committed_example_names_each_culprit_and_the_ettr():
    module, function = nvrx_entry_point().split(":")
    # what the console script the installer writes does: sys.argv as typed, sys.exit(main())
    proc = run_without_torch(
        f"import sys\nfrom {module} import {function} as main\n"
        f"sys.argv = ['nvrx', 'report', {EXAMPLE!r}]\n"
        "code = main()\n"
        "sys.stdout.flush()\n"
        "assert 'torch' not in sys.modules, 'nvrx report imported torch'\n"
        "if code:\n    raise SystemExit(code)\n")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    # The example's two faults: rank 1 killed in cycle 0, rank 0 hung in cycle 1.
    assert "incidents: 2" in text, text
    assert "\ncycle 0: rank killed: culprit rank 1\n" in text, text
    assert "cycle 1: hang: culprit rank 0; waiting: rank 1" in text, text
    assert "ETTR " in text and "where the time went: productive" in text, text
    # Nothing in the report depends on torch being there: the same text as with torch.
    assert text == build_report(EXAMPLE).text() + "\n"


def test_the_example_is_small_and_comes_from_a_real_run():
    assert os.path.getsize(EXAMPLE) < 100_000
    with open(EXAMPLE) as f:
        kinds = {json.loads(line)["kind"] for line in f}
    # written by the launcher, the node monitor and the ranks, not by hand
    assert {"launcher_started", "workers_started", "rank_killed", "hang_evidence", "step_done",
            "launcher_exit"} <= kinds, kinds
