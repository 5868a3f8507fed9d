"""What the plugins set on a NeMo-Run executor: our ft_launcher, its config, the finished
flag, and how a preempted job ends. Only fields of the executor: a plugin's `setup` writes no
file and makes no call through the tunnel, on any executor and in a dry run, since it may run
on a laptop for a remote cluster before any job directory exists.

NeMo-Run turns `run.FaultTolerance` into an `ft_launcher` command line, but it drops every
unset or zero value and has no flag for section timeouts. The full fault-tolerance config
therefore also travels in the executor's environment ($NVRX_FT_CONFIG, nvrx_core.ft.config_env),
which every executor passes to the job; ft_launcher reads it after the YAML file that
`FAULT_TOL_CFG_PATH` may name (NeMo-Run's Slurm template exports that path and never writes it)
and before its flags.
"""

import os
from typing import Any, Dict, Optional

from nvrx_core.exit_codes import PREEMPTED_EXIT_CODE_ENV
from nvrx_core.ft import config_env
from nvrx_core.ft.finished import FINISHED_FLAG_ENV

LOCAL_FINISHED_FLAG = "finished_flag"


def install_ft_config(executor: Any, values: Dict[str, Any]) -> str:
    """Put the fault-tolerance config into the executor's environment; the variable's value."""
    text = config_env.encode(values)
    executor.env_vars[config_env.FT_CONFIG_ENV] = text
    return text


def install_finished_flag(executor: Any, run: Any, path: Optional[str]) -> Optional[str]:
    """For a non-Slurm job, the finished-flag path the job writes when training completes (the
    Slurm template sets its own and requeues until the flag exists): the one given, else one in
    the job directory that run.Experiment assigned. With neither (an executor used on its own),
    none: the job then runs without the flag."""
    if isinstance(executor, run.SlurmExecutor):
        return None
    job_dir = getattr(executor, "job_dir", "")
    flag = path or (os.path.join(job_dir, LOCAL_FINISHED_FLAG) if job_dir else None)
    if flag:
        executor.env_vars[FINISHED_FLAG_ENV] = flag
    return flag


def requeue_when_preempted(executor: Any, run: Any) -> None:
    """On Slurm, end a preempted job with 0: NeMo-Run's template counts any other code as a
    failed attempt against `retries`, and requeues a job that exits 0 unfinished."""
    if isinstance(executor, run.SlurmExecutor):
        executor.env_vars[PREEMPTED_EXIT_CODE_ENV] = "0"


def preemption_signal(executor: Any, run: Any, name: str, seconds: int) -> None:
    """Slurm's `--signal=NAME@SECONDS`: the signal, that long before the time limit."""
    if isinstance(executor, run.SlurmExecutor):
        executor.signal = f"{name[3:] if name.startswith('SIG') else name}@{seconds}"
