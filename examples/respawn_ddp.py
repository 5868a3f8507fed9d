"""DDP on gloo whose killed rank is replaced alone: the others keep their processes and memory.

    ft_launcher --nproc-per-node 4 --ft-restart-policy respawn-rank \\
        examples/respawn_ddp.py --workdir /tmp/respawn --fault kill:2:30

When rank 2 dies, ft_launcher forks one new process for rank 2 from its warm fork server;
ranks 0, 1 and 3 leave the broken iteration inside the in-process Wrapper, wait for it, and
all four meet in the next iteration: the replacement gets the model and optimizer of the
rank with the newest committed step (`roll_forward`), and training goes on from that step,
none redone. Without the policy (or when the launcher decides otherwise: a hang, a spent
respawn budget) every rank restarts and resumes from the last checkpoint in --workdir.

Faults (each fires once per --workdir, on the initial rank named):
  kill:R:S[:D]       rank R SIGKILLs itself at the start of step S (D seconds later, from a timer)
  kill_in_roll:R     rank R SIGKILLs itself as the state transfer of the first restart begins
  kill_replacement:R the first replacement of rank R SIGKILLs itself as it joins

Each rank appends "step wall_time pid" to <workdir>/steps.rank<R> per committed step, and
writes its weights' SHA-256 to <workdir>/weights.rank<R> at the end.
"""

import argparse
import hashlib
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from nvrx_core.inprocess import RestartState, Wrapper
from nvrx_core.inprocess.roll_forward import TorchRNG, roll_forward


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="checkpoint, fault markers, step logs and results")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds per step (slept out)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints (rank 0)")
    parser.add_argument("--fault", action="append", default=[], help="see the module docstring")
    parser.add_argument("--soft-timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    for fault in args.fault:
        kind = fault.split(":")[0]
        if kind not in ("kill", "kill_in_roll", "kill_replacement"):
            parser.error(f"--fault {fault!r}: unknown kind {kind!r}")
    return args


def fire_once(workdir: str, name: str) -> bool:
    """True the first time `name` fires in this workdir (the marker outlives the process)."""
    try:
        os.close(os.open(os.path.join(workdir, f"fault.{name}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def die(workdir: str, name: str) -> None:
    with open(os.path.join(workdir, f"killed.{name}"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def faults_of(args, kind: str, rank: int):
    for fault in args.fault:
        parts = fault.split(":")
        if parts[0] == kind and int(parts[1]) == rank:
            yield fault, parts[2:]


def inject_step_faults(args, rank: int, step: int) -> None:
    for fault, rest in faults_of(args, "kill", rank):
        if int(rest[0]) == step and fire_once(args.workdir, fault):
            delay = float(rest[1]) if len(rest) > 1 else 0.0
            if delay:
                threading.Timer(delay, die, (args.workdir, fault)).start()
            else:
                die(args.workdir, fault)


def batch(step: int, rank: int):
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(32, 64, generator=generator), torch.randn(32, 8, generator=generator)


def weights_digest(model) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def save_checkpoint(path: str, model, optimizer, step: int) -> None:
    tmp = f"{path}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    checkpoint = os.path.join(args.workdir, "checkpoint.pt")
    committed = {"step": None}  # None: this process holds no state of the job yet
    replacement = os.environ.get("NVRX_RANK_INCARNATION", "0") not in ("", "0")
    if replacement:
        for fault, _ in faults_of(args, "kill_replacement", rank):
            if fire_once(args.workdir, fault):
                threading.Timer(0.0, die, (args.workdir, fault)).start()
    elif os.path.exists(checkpoint):  # a restart of every rank: the last checkpoint
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        committed["step"] = saved["step"]
    else:
        committed["step"] = 0
    log = open(os.path.join(args.workdir, f"steps.rank{rank}"), "a", buffering=1)
    # Without respawn-rank the launcher restarts every rank when one dies: the Wrapper then
    # makes no restart of its own (max_iterations=1), or the others would train on shrunk.
    respawning = os.environ.get("NVRX_RESTART_POLICY") == "respawn-rank"
    wrapper = Wrapper(soft_timeout=args.soft_timeout, hard_timeout=args.soft_timeout + 10,
                      heartbeat_interval=0.5, heartbeat_timeout=10, monitor_interval=0.05,
                      barrier_timeout=60, respawn_timeout=30, max_iterations=None if respawning else 1)

    @wrapper
    def train(state: RestartState):
        state.init_process_group("gloo")
        if state.iteration > 0:
            for fault, _ in faults_of(args, "kill_in_roll", rank):
                if fire_once(args.workdir, fault):
                    die(args.workdir, fault)
        step = roll_forward(state, committed["step"], {"model": model, "optimizer": optimizer, "rng": TorchRNG()})
        committed["step"] = step
        # The same gradient buckets from a DDP's first step on (one parameter each): by default DDP
        # reduces its first step in one bucket and rebuilds them after it, so the step a restart
        # repeats would sum in another order, with other bits, than in a run without a fault.
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb_list=[1e-6])
        while step < args.steps:
            began = time.monotonic()
            inject_step_faults(args, rank, step)
            inputs, targets = batch(step, state.rank)
            loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            with state.atomic():  # the step and its record are one: a restart lands before or after both
                optimizer.step()
                step += 1
                committed["step"] = step
                log.write(f"{step} {time.time():.6f} {os.getpid()}\n")
            if rank == 0 and step % args.checkpoint_every == 0:
                save_checkpoint(checkpoint, model, optimizer, step)
            time.sleep(max(0.0, args.step_time - (time.monotonic() - began)))
        dist.barrier()

    train()
    with open(os.path.join(args.workdir, f"weights.rank{rank}"), "w") as f:
        f.write(weights_digest(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
