import os
import sys

import pytest

# tests import their helpers by plain name (the harness package, warm_python, ...)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# helpers that assert for the tests calling them: their failures get pytest's detailed messages
pytest.register_assert_rewrite("megatron_trainer")

# The files that take longest (seconds of test time, unloaded, `pytest -n 2 --durations=0`),
# handed to xdist's workers first (`--dist loadfile --no-loadscope-reorder` deals files out in
# collection order; xdist's default order is by number of tests, which dealt the Slurm files last):
# a long file dealt last would leave the other workers idle while it runs.
SLOWEST_FILES_FIRST = (
    "test_slurm_sbatch.py",              # ~130, real Slurm jobs; holds the cluster (slurm_cluster.exclusive)
    "test_slurm_nemo_run.py",            # ~360 (most of it Slurm's waits), after the cluster is free
    "test_ft_launcher.py",               # 154
    "test_multinode.py",                 # 122 (paced to outlast spares' startup under load)
    "test_megatron_trainer.py",          # 93
    "test_hf_ft.py",                     # ~100 (three 2-rank Trainer runs, seven restarts)
    "test_hf_preemption.py",             # ~48
    "test_ft_torchrun_parity.py",        # ~70 (three combined runs: ours warm, cold, torchrun)
    "test_nemo_run_jobs.py",             # 69
    "test_lightning_ft.py",              # 68
    "test_ft_safety_net.py",             # 53
    "test_megatron_trainer_all_on.py",   # 51
    "test_straggler_dist.py",            # 38
    "test_respawn.py",                   # ~30 (5 respawn-rank jobs under ft_launcher)
    "test_ft_respawn_agent.py",          # ~28
    "test_inprocess_replacement.py",     # ~20
    "test_lightning_preemption.py",      # 34
    "test_inprocess_return_race.py",     # 34
    "test_checkpoint_multirank.py",      # 34
    "test_rerun_multirank.py",           # 27
    "test_ft_warm_start.py",             # 23
    "test_report_runs.py",               # 21
    "test_inprocess_multirank.py",       # 21
    "test_inprocess_example.py",         # 21
)


def pytest_collection_modifyitems(session, config, items):
    first = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: tests keep their order
