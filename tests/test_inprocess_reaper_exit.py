"""The interpreter's exit waits for the thread destroying an in-process restart's aborted
process groups: a gloo worker still alive at finalization ends the process with
std::terminate (exit -6) after a job that recovered and finished."""

import subprocess
import sys
import textwrap


def test_the_interpreter_exits_only_after_the_aborted_groups_are_destroyed(tmp_path):
    marker = tmp_path / "destroyed"
    script = textwrap.dedent(f"""
        import time
        from nvrx_core.inprocess.abort import AbortProcessGroups, IterationConnections

        class SlowGroup:                      # stands for a gloo group whose destructor joins workers
            def __del__(self):
                time.sleep(1.0)
                open({str(marker)!r}, "w").close()

        aborter = AbortProcessGroups(IterationConnections())
        aborter._held[1] = SlowGroup()        # what hold_current() keeps of an aborted iteration
        aborter.release()                     # a daemon thread drops it
        # the script ends here, at once: the interpreter must wait for that thread
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.exists()
