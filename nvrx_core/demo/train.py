"""A small, deterministic DDP job (gloo, CPU) used by `nvrx demo`, the tests and bench/.

Deterministic on purpose: the batch of step k depends only on (seed, k), so a run that
crashes, restarts and resumes from its last checkpoint must end with bit-identical weights
to a run that never failed; the weights hash printed at the end proves it.

Run it under ft_launcher (or torchrun):
    ft_launcher --nproc-per-node 2 -m nvrx_core.demo.train --steps 60 --ckpt-dir /tmp/ck
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nvrx_core import events as ev
from nvrx_core.durable import atomic_write_bytes, atomic_write_with
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.faults import FaultInjector, SimulatedFault
from nvrx_core.ft.finished import write_finished_flag

CHECKPOINT = "checkpoint.pt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.05, help="pad each step to this many seconds")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--mode", choices=("heartbeat", "sections"), default="heartbeat")
    p.add_argument("--calc-timeouts-at", type=int, default=None,
                   help="call calculate_and_set_timeouts() after this step (and save them with the checkpoint)")
    p.add_argument("--fault", action="append", default=[], metavar="KIND:RANK:ITER[:CYCLE]",
                   help="simulated fault, e.g. rank_killed:1:15 or rank_hung:0:30:1")
    p.add_argument("--fault-after", action="append", default=[], metavar="KIND:RANK:SECONDS[:CYCLE]",
                   help="time-based simulated fault (fires from a thread after SECONDS)")
    p.add_argument("--fault-file", default=None,
                   help="faults requested while the job runs (bench/soak.py): see FaultRequests")
    p.add_argument("--hash-file", default=None, help="rank 0 writes the final weights hash here")
    p.add_argument("--progress", action="store_true", help="rank 0 prints a line per step")
    return p.parse_args(argv)


def parse_fault(spec: str, time_based: bool) -> SimulatedFault:
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise SystemExit(f"bad fault spec {spec!r}: expected KIND:RANK:{'SECONDS' if time_based else 'ITER'}[:CYCLE]")
    kind, rank, when = parts[:3]
    cycle = int(parts[3]) if len(parts) == 4 else 0
    if time_based:
        return SimulatedFault(kind, rank_to_fail=int(rank), base_delay=float(when), cycle=cycle)
    return SimulatedFault(kind, rank_to_fail=int(rank), at_iteration=int(when), cycle=cycle)


class FaultRequests:
    """Faults asked for from outside while the job runs, each fired once, by one rank.

    The file holds JSON {"id": n, "rank": r, "kind": k} (k a SimulatedFault kind). A rank
    looks at it each step; the rank it names claims the request by creating `PATH.<id>.fired`
    (O_EXCL), so a restarted job does not fire it again."""

    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank

    def maybe_inject(self, step: int) -> None:
        try:
            with open(self.path) as f:
                request = json.load(f)
        except (OSError, ValueError):
            return
        if not isinstance(request, dict) or request.get("rank") != self.rank:
            return
        try:
            os.close(os.open(f"{self.path}.{request.get('id')}.fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        FaultInjector(SimulatedFault(str(request.get("kind")), rank_to_fail=self.rank, at_iteration=step,
                                     cycle=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))).maybe_inject(step)


def weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(bytes(tensor.detach().contiguous().flatten().view(torch.uint8).tolist()))
    return h.hexdigest()[:16]


def batch(seed: int, step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(world * 16, 64, generator=g)
    y = torch.randn(world * 16, 8, generator=g)
    return x[rank * 16:(rank + 1) * 16], y[rank * 16:(rank + 1) * 16]


def main(argv=None) -> int:
    args = parse_args(argv)
    client = RankMonitorClient()
    client.init_workload_monitoring()
    injectors = [FaultInjector(parse_fault(s, False)) for s in args.fault]
    injectors += [FaultInjector(parse_fault(s, True)) for s in args.fault_after]
    for injector in injectors:
        injector.start()

    if args.mode == "sections":
        client.start_section("setup")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    events = ev.EventLog.from_env(source="train")
    torch.manual_seed(args.seed)
    # find_unused_parameters=True keeps DDP from re-bucketing after its first iteration: a
    # resumed run's first step would otherwise sum gradients in another order (4+ ranks).
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(args.ckpt_dir, CHECKPOINT)
    start = 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        client.load_state(args.ckpt_dir)
    if args.mode == "sections":
        client.end_section("setup")
    events.emit(ev.TRAINING_RESUMED, step=start)
    if args.fault_file:
        injectors.append(FaultRequests(args.fault_file, rank))

    for step in range(start + 1, args.steps + 1):
        t0 = time.monotonic()
        for injector in injectors:
            injector.maybe_inject(step)
        if args.mode == "sections":
            client.start_section("step")
        x, y = batch(args.seed, step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(max(0.0, args.step_time - (time.monotonic() - t0)))
        if args.mode == "sections":
            client.end_section("step")
        else:
            client.send_heartbeat()
        client.report_progress(step)
        if rank == 0 and not client.is_active:  # under ft_launcher the client writes the step timeline
            events.emit(ev.STEP_DONE, step=step)
        if rank == 0:
            if args.progress:
                print(f"  cycle {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} step {step:3d}/{args.steps} "
                      f"loss {loss.item():.4f}", flush=True)
        if args.calc_timeouts_at is not None and step == args.calc_timeouts_at:
            client.calculate_and_set_timeouts()
        if step % args.ckpt_every == 0 or step == args.steps:
            if args.mode == "sections":
                client.start_section("checkpointing")
            if rank == 0:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                atomic_write_with(path, lambda f: torch.save(state, f))
                client.save_state(args.ckpt_dir)
                events.emit(ev.CHECKPOINT_COMMITTED, step=step)
            dist.barrier()
            if args.mode == "sections":
                client.end_section("checkpointing")

    digest = weights_hash(model.module)
    if rank == 0:
        if args.hash_file:
            atomic_write_bytes(args.hash_file, digest.encode() + b"\n")
        write_finished_flag()
        print(f"final weights hash {digest}", flush=True)
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
