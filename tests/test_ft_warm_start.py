"""Workers under ft_launcher see what `python train.py` under torchrun shows them, and
nothing a worker started outlives its restart cycle or the job (real launcher, real
DataLoader worker processes, a real SIGKILLed rank)."""

import json
import os
import subprocess
import sys

import pytest

from harness.launcher import SCRIPTS, alive, run_launcher
from harness import wait_for
from nvrx_core.ft.process_groups import kill_process_groups, live_group_members

pytestmark = pytest.mark.timeout(240)

SCRIPT = os.path.join(SCRIPTS, "loader_no_main_guard.py")
# Every rank iterates the whole 0..63 data set twice; each step all-reduces over 2 ranks.
EXPECTED_TOTAL = 2 * 2 * sum(range(64))


def plain_python_start_method() -> str:
    return subprocess.run([sys.executable, "-c", "import multiprocessing as m; print(m.get_start_method())"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("start", [[], ["--no-warm-start"]], ids=["warm", "cold"])
def test_script_without_main_guard_and_dataloader_workers_survives_a_killed_rank(tmp_path, start):
    out = tmp_path / "out"
    out.mkdir()
    result = run_launcher(["--nproc-per-node", "2", "--max-restarts", "2", *start, SCRIPT, str(out), "5"])
    assert result.returncode == 0, result.stdout[-4000:]
    reports = {name[:-5]: json.loads((out / name).read_text()) for name in os.listdir(out)}
    assert {"rank0.cycle1", "rank1.cycle1", "rank1.cycle0"} <= set(reports), sorted(reports)

    expected_method = plain_python_start_method()
    for rank in (0, 1):
        final = reports[f"rank{rank}.cycle1"]
        assert final["total"] == EXPECTED_TOTAL
        assert final["start_method"] == expected_method
        assert final["process_name"] == "MainProcess"
        assert final["own_process_group"]
        # The killed rank's persistent DataLoader workers were gone before cycle 1 started.
        assert final["survivors_of_earlier_cycles"] == []
    assert len(reports["rank1.cycle0"]["descendants"]) >= 2  # the DataLoader workers existed

    leftovers = [pid for r in reports.values() for pid, started in r["descendants"] if alive(pid, started)]
    assert leftovers == [], "processes started by workers outlived ft_launcher"


def test_kill_process_groups_takes_children_of_a_dead_leader(tmp_path):
    """The case torch's agent misses: the group's leader is gone, its children are not."""
    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            "print(child.pid, flush=True)\n"
            "os._exit(0)\n")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = int(leader.stdout.readline())
    leader.wait(timeout=60)
    try:
        assert live_group_members({leader.pid}) == {child}
        assert kill_process_groups([leader.pid], timeout=30) == []
        assert live_group_members({leader.pid}) == set()
    finally:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("start", [[], ["--no-warm-start"]], ids=["warm", "cold"])
def test_an_uncaught_exception_prints_its_traceback_as_plain_python_does(start):
    """A warm-started worker runs the script as a function of torch's process context, which
    would hand the traceback only to the agent: the user must see it, as with `python train.py`."""
    result = run_launcher(["--nproc-per-node", "1", "--max-restarts", "0", *start,
                           os.path.join(SCRIPTS, "fail_job.py"), "--raise-error", "boom from the script"])
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stdout, result.stdout[-3000:]
    assert "RuntimeError: boom from the script" in result.stdout, result.stdout[-3000:]


def test_a_launcher_that_imported_torch_forks_its_fork_server_which_ends_with_the_launcher(tmp_path):
    """ft_launcher forked from a process holding torch (as run_launcher starts it) forks its fork
    server instead of starting a new interpreter that imports torch again; the server holds the
    descriptors a new interpreter would (none of the launcher's), so it ends with the launcher."""
    cold = subprocess.run([sys.executable, "-m", "nvrx_core.ft.command", "--nproc-per-node", "1",
                           os.path.join(SCRIPTS, "fork_server_probe.py"), str(tmp_path / "cold.json")],
                          capture_output=True, text=True, timeout=180)
    assert cold.returncode == 0, cold.stdout[-3000:] + cold.stderr[-3000:]
    warm = run_launcher(["--nproc-per-node", "1", os.path.join(SCRIPTS, "fork_server_probe.py"),
                         str(tmp_path / "warm.json")])
    assert warm.returncode == 0, warm.stdout[-3000:]
    cold, warm = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("cold", "warm"))
    assert cold["server_is_new_interpreter"] and not warm["server_is_new_interpreter"]
    for probe in (cold, warm):
        assert probe["server_parent"] == probe["launcher"]
        wait_for(lambda: not alive(probe["server"], probe["server_started"]), 60, "the fork server to end with its launcher")
    # the same kinds of descriptors (stdio, sockets, pipes, epoll), and not one more of any
    assert sorted(_kinds(warm["server_fds"])) == sorted(_kinds(cold["server_fds"])), (warm, cold)


def _kinds(fds):
    return [target.split(":")[0] if ":" in target else "file" for fd, target in fds.items() if int(fd) > 2]
