"""What the plugins set on a NeMo-Run executor: our ft_launcher, its config file, the
finished flag, and how a preempted job ends.

NeMo-Run turns `run.FaultTolerance` into an `ft_launcher` command line, but it drops every
unset or zero value and has no flag for section timeouts. The full fault-tolerance config
therefore also goes into a YAML file (`fault_tolerance:` section) that `FAULT_TOL_CFG_PATH`
names; ft_launcher reads it first and the command line's flags on top:
- LocalExecutor: the file goes into a private temporary directory (the experiment directory
  does not exist yet when plugins run), and the plugin exports its path and a finished-flag
  path in the job directory (NeMo-Run exports neither for local jobs);
- SlurmExecutor: the template exports `FAULT_TOL_CFG_PATH` naming `<job>_ft_cfg.yml` in the
  job directory on the cluster side but never writes it. The sbatch script writes it there
  itself (the executor's `setup_lines`), when the job starts: plugins run before NeMo-Run
  creates that directory, and NeMo-Run refuses an experiment directory that already exists
  (the usual LocalTunnel layout, whose job dir is the experiments dir, makes them one).
"""

import os
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import yaml

from nvrx_core.durable import atomic_write_bytes
from nvrx_core.exit_codes import PREEMPTED_EXIT_CODE_ENV
from nvrx_core.ft.config import CONFIG_PATH_ENV, YAML_SECTION
from nvrx_core.ft.finished import FINISHED_FLAG_ENV

LOCAL_FT_CONFIG = "ft_cfg.yml"
LOCAL_FINISHED_FLAG = "finished_flag"


def ft_config_yaml(values: Dict[str, Any]) -> str:
    return yaml.safe_dump({YAML_SECTION: values}, sort_keys=False)


def install_ft_config(executor: Any, run: Any, values: Dict[str, Any]) -> str:
    """Write the fault-tolerance YAML where this executor's ft_launcher will look; its path."""
    text = ft_config_yaml(values)
    if isinstance(executor, run.SlurmExecutor):
        return _write_from_the_sbatch_script(executor, text)
    # Not in the job directory: plugins run before NeMo-Run creates the experiment directory,
    # and it refuses one that already exists.
    path = os.path.join(tempfile.mkdtemp(prefix=f"nvrx-ft-{_job_name(executor)}-"), LOCAL_FT_CONFIG)
    atomic_write_bytes(path, text.encode())
    executor.env_vars[CONFIG_PATH_ENV] = path
    return path


def slurm_ft_config_path(executor: Any) -> str:
    """Where NeMo-Run's Slurm template points FAULT_TOL_CFG_PATH (its own rule, in
    SlurmExecutor._setup_launcher)."""
    base = os.path.join(executor.tunnel.job_dir, Path(executor.job_dir).name)
    return os.path.join(base, f"{executor.job_name}_ft_cfg.yml")


SETUP_MARK = "# nvrx-suite: write the fault-tolerance YAML that FAULT_TOL_CFG_PATH names"
_DELIMITER = "NVRX_FT_CFG_EOF"


def _write_from_the_sbatch_script(executor: Any, text: str) -> str:
    """Add shell lines to the executor's `setup_lines` that write the YAML on the cluster side
    when the job starts (each attempt: a requeued job writes it again, unchanged). A second
    setup replaces its own lines and keeps the user's."""
    remote = slurm_ft_config_path(executor)
    block = "\n".join([SETUP_MARK, f"mkdir -p {shlex.quote(os.path.dirname(remote))}",
                       f"cat > {shlex.quote(remote)} <<'{_DELIMITER}'", text.rstrip("\n"), _DELIMITER])
    ours = re.compile(rf"\n?{re.escape(SETUP_MARK)}\n.*?\n{_DELIMITER}(\n|$)", re.S)
    user = ours.sub("", executor.setup_lines or "").rstrip("\n")
    executor.setup_lines = f"{user}\n{block}" if user else block
    return remote


def install_finished_flag(executor: Any, run: Any, path: Optional[str]) -> Optional[str]:
    """For a local job, the finished-flag path the job writes when training completes (the
    Slurm template sets its own and requeues until the flag exists)."""
    if isinstance(executor, run.SlurmExecutor):
        return None
    flag = path or os.path.join(_job_dir(executor), LOCAL_FINISHED_FLAG)
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


def _job_name(executor: Any) -> str:
    return os.path.basename(_job_dir(executor).rstrip(os.sep)) or "job"


def _job_dir(executor: Any) -> str:
    job_dir = getattr(executor, "job_dir", "")
    if not job_dir:
        raise ValueError(f"{type(executor).__name__} has no job_dir yet: use the plugin through run.run or "
                         "run.Experiment, which assign the executor before calling setup")
    return job_dir
