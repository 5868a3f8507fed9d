"""DDP on gloo that survives an exception, a hang and a killed rank without restarting processes.

Run it standalone (it starts its own ranks, with one warm reserve):

    python examples/inprocess_ddp.py --ranks 4 --faults exception,hang,kill

or under a launcher (the Wrapper then coordinates through the launcher's store; a killed
rank is handled by the launcher itself, which restarts all processes):

    ft_launcher --nproc-per-node 4 examples/inprocess_ddp.py --faults exception,hang

What it shows: the model and optimizer live in memory across faults; after each fault
the function is called again with state.iteration + 1, rebuilds the process group and
DDP, takes the newest step every rank has, and continues. At the end every rank prints
a checksum of its weights; they must agree.
"""

import argparse
import hashlib
import logging
import multiprocessing
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

STEPS, STEP_TIME = 40, 0.05
FAULTS = {"exception": (10, 1), "hang": (20, 2), "kill": (30, 0)}  # fault -> (step, initial rank)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks to start when run standalone")
    parser.add_argument("--reserves", type=int, default=1, help="warm reserves among them (standalone only)")
    parser.add_argument("--faults", default="exception,hang,kill",
                        help=f"comma-separated, each once: {', '.join(f'{k} (rank {r}, step {s})' for k, (s, r) in FAULTS.items())}")
    parser.add_argument("--soft-timeout", type=float, default=3.0, help="a hang is interrupted after this many seconds")
    parser.add_argument("--workdir", default=None, help="where fault markers and results go (default: a temp dir)")
    args = parser.parse_args(argv)
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        parser.error(f"--faults: unknown {sorted(unknown)}; choose from {sorted(FAULTS)}")
    return args


def inject(fault_names, workdir, state, step):
    """Each requested fault fires once, at its step, on its initial rank."""
    for name in fault_names:
        at_step, rank = FAULTS[name]
        marker = os.path.join(workdir, f"{name}.done")
        if step != at_step or state.initial_rank != rank or os.path.exists(marker):
            continue
        open(marker, "w").close()
        print(f"[rank {state.initial_rank}] injecting {name} at step {step}", flush=True)
        if name == "exception":
            raise RuntimeError("injected exception")
        if name == "hang":
            time.sleep(3600)  # GIL released: the soft timeout interrupts it
        if name == "kill":
            os.kill(os.getpid(), signal.SIGKILL)


def train(args, workdir):
    from nvrx_core.inprocess import RestartState, Wrapper

    active = None
    if "TORCHELASTIC_RUN_ID" not in os.environ and args.reserves:
        active = int(os.environ["WORLD_SIZE"]) - args.reserves
    wrapper = Wrapper(soft_timeout=args.soft_timeout, hard_timeout=args.soft_timeout + 5,
                      heartbeat_interval=0.5, heartbeat_timeout=10, monitor_interval=0.2,
                      barrier_timeout=60, active_world_size=active)
    memory = {}  # step -> model/optimizer state; survives restarts because the process does

    @wrapper
    def run(state: RestartState):
        state.init_process_group("gloo")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        step = resume(model, memory, state)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        print(f"[rank {state.initial_rank}] iteration {state.iteration}: rank {state.rank}/{state.world_size}, "
              f"resuming at step {step}", flush=True)
        while step < STEPS:
            began = time.monotonic()
            inject(args.faults, workdir, state, step)
            data = torch.randn(16, 32, generator=torch.Generator().manual_seed(step * 100 + state.rank))
            loss = ddp(data).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            memory[step] = {k: v.clone() for k, v in model.state_dict().items()}
            memory.pop(step - 2, None)
            time.sleep(max(0.0, STEP_TIME - (time.monotonic() - began)))
        return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]

    return run()


def resume(model, memory, state) -> int:
    """After a restart: the newest step every rank has, from the lowest rank that has it (reserves have none)."""
    if state.iteration == 0:
        return 0
    nothing = STEPS + 1
    newest = torch.tensor([max(memory) if memory else nothing])
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    step = int(newest)
    if step == nothing:
        return 0
    source = torch.tensor([state.rank if step in memory else state.world_size])
    dist.all_reduce(source, op=dist.ReduceOp.MIN)
    if step in memory:
        model.load_state_dict(memory[step])
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=int(source))
    return step


def rank_main(rank, world, port, args, workdir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1")
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(name)s %(message)s")
    torch.set_num_threads(1)
    checksum = train(args, workdir)
    if checksum is not None:  # reserves that never trained return None
        print(f"[rank {rank}] finished; weights checksum {checksum}", flush=True)
        with open(os.path.join(workdir, f"checksum.rank{rank}"), "w") as f:
            f.write(checksum)


def standalone(args) -> int:
    """Start the ranks here, hosting the coordination store as a launcher's agent would."""
    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="nvrx-inprocess-example-")
    os.makedirs(workdir, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "nvrx_core.inprocess"])
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, store.port, args, workdir)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    sums = {open(os.path.join(workdir, f)).read() for f in os.listdir(workdir) if f.startswith("checksum.")}
    print(f"exit codes {codes}; distinct weight checksums among finished ranks: {sorted(sums)}")
    killed = {FAULTS["kill"][1]} if "kill" in args.faults else set()
    ok = len(sums) == 1 and all(c == 0 for r, c in enumerate(codes) if r not in killed)
    print("OK: training survived the faults in-process" if ok else "FAILED")
    return 0 if ok else 1


def main() -> int:
    args = parse_args()
    if "RANK" in os.environ:  # under torchrun / ft_launcher: this process is one rank
        workdir = args.workdir or os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                               f"nvrx-inprocess-example-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
        os.makedirs(workdir, exist_ok=True)
        checksum = train(args, workdir)
        print(f"[rank {os.environ['RANK']}] finished; weights checksum {checksum}", flush=True)
        return 0
    return standalone(args)


if __name__ == "__main__":
    sys.exit(main())
