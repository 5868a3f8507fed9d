"""NeMo-Run with nvrx-suite's plugins: the Megatron-style reference trainer on 2 local ranks
under our ft_launcher, as a run.Script or as a run.Partial of its ConfigContainer.

    python examples/nemo_run_ft.py --root /tmp/nemo_run_ft              # run.Script
    python examples/nemo_run_ft.py --root /tmp/nemo_run_ft --partial    # run.Partial
    python examples/nemo_run_ft.py --root /tmp/nemo_run_ft --dryrun     # print what would run

`--kill-rank-after S` kills rank 1 S seconds in (Bridge's simulated fault): the job restarts it
in place and finishes. On a cluster, swap the executor for `run.SlurmExecutor(...)`: the plugins
then also ask Slurm for SIGTERM 60 s before the time limit and make a preempted job requeue
instead of counting as failed (the fault-tolerance config travels in the job's environment,
NVRX_FT_CONFIG, on every executor).
"""

import argparse
import os
import sys

import nemo_run as run

from nvrx_nemo_run import FaultTolerancePlugin, PreemptionPlugin

MEGATRON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_style")
sys.path.insert(0, MEGATRON_DIR)

import bridge_style  # noqa: E402
import pretrain_gpt  # noqa: E402
from nvrx_megatron import FaultToleranceConfig  # noqa: E402


def script_task(root: str, iters: int, kill_after: int):
    args = ["--save", os.path.join(root, "ckpt"), "--train-iters", str(iters), "--step-time", "0.03"]
    if kill_after:
        args += ["--simulated-fault", f"rank_killed:1:{kill_after}"]
    return run.Script(path=pretrain_gpt.__file__, entrypoint="python", args=args)


def partial_task(root: str, iters: int, kill_after: int):
    ft = run.Config(FaultToleranceConfig)
    if kill_after:
        ft = run.Config(FaultToleranceConfig, simulate_fault=True, simulated_fault_type="rank_killed",
                        simulated_fault_rank=1, simulated_fault_base_delay=kill_after)
    cfg = run.Config(bridge_style.ConfigContainer,
                     train=run.Config(bridge_style.TrainConfig, train_iters=iters),
                     checkpoint=run.Config(bridge_style.CheckpointConfig, save=os.path.join(root, "ckpt")),
                     ft=ft)
    return run.Partial(pretrain_gpt.pretrain_tiny_gpt, cfg=cfg, step_time=0.03)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--kill-rank-after", type=int, default=3, metavar="S", help="0: no fault")
    parser.add_argument("--partial", action="store_true")
    parser.add_argument("--dryrun", action="store_true")
    args = parser.parse_args()

    make_task = partial_task if args.partial else script_task
    executor = run.LocalExecutor(ntasks_per_node=2, env_vars={"PYTHONPATH": MEGATRON_DIR, "OMP_NUM_THREADS": "1"})
    plugins = [FaultTolerancePlugin(initial_rank_heartbeat_timeout=300, rank_heartbeat_timeout=60),
               PreemptionPlugin()]
    run.run(make_task(args.root, args.iters, args.kill_rank_after), executor=executor, plugins=plugins,
            name="tiny_gpt", dryrun=args.dryrun)


if __name__ == "__main__":
    main()
