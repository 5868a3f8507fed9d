"""nvrx_core.teardown: exit hooks run while the interpreter is still whole, and the module
stays torch-free (ft.warm_start imports it before the launcher imports torch)."""

import subprocess
import sys
import textwrap


def test_a_hook_runs_after_the_main_code_and_before_atexit_and_the_module_imports_no_torch():
    script = textwrap.dedent("""
        import atexit, functools, sys
        from nvrx_core import teardown
        assert "torch" not in sys.modules, "nvrx_core.teardown imported torch"
        atexit.register(print, "atexit hook", flush=True)
        assert teardown.finish_before_exit(functools.partial(print, "teardown hook", flush=True))
        teardown.keep_until_exit(object())
        print("main code ends", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["main code ends", "teardown hook", "atexit hook"]
