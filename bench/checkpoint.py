"""Benchmark: how long a checkpoint save blocks the training loop, and how much the
background write slows the steps that run meanwhile.

    .venv/bin/python bench/checkpoint.py [--peer-python PATH] [--gib 1.0] [--saves 3]

Same run, same 1 GiB CPU state dict (64 float32 tensors), written to a temp dir under /tmp:
  ours             nvrx_core.checkpoint.AsyncCheckpointer (staging buffers reused)
  torch.save       synchronous
  dcp.async_save   torch.distributed.checkpoint.async_save on a 1-rank gloo group
  nvrx-0.4.1       nvidia-resiliency-ext's async checkpoint queue, run in the peer venv
Blocking time = time inside the save call plus every finalize/poll call made while the
write runs. With a CUDA device, a GPU section times a 4 GiB CUDA state the same way.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

TENSORS = 64
BENCH_MATMUL = 128          # small enough to run on one thread: steady step times
MATMULS_PER_STEP = 40
QUIET_STEPS = 100           # undisturbed steps sampled before and after each save


def make_state(gib: float, device: str = "cpu", dtype=torch.float32) -> dict:
    per_tensor = int(gib * (1 << 30)) // TENSORS // torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per_tensor, generator=gen).to(device=device, dtype=dtype)
            for i in range(TENSORS)}


class ComputeLoop:
    """A small stand-in for training steps; its step time shows background interference."""

    def __init__(self):
        gen = torch.Generator().manual_seed(1)
        self.a = torch.randn(BENCH_MATMUL, BENCH_MATMUL, generator=gen)
        self.b = torch.randn(BENCH_MATMUL, BENCH_MATMUL, generator=gen)
        self.out = torch.empty(BENCH_MATMUL, BENCH_MATMUL)

    def step(self) -> float:
        began = time.perf_counter()
        for _ in range(MATMULS_PER_STEP):          # same inputs every step: constant work
            torch.mm(self.a, self.b, out=self.out)
        return time.perf_counter() - began


def run_async(save, poll, loop: ComputeLoop, saves: int, timeout: float = 300.0) -> dict:
    """save(i) starts save i; poll() -> True once it is durable. Steps run until then.
    Each save starts with no dirty page-cache backlog (os.sync), as for torch.save; the
    undisturbed step time is sampled right before each save and right after it is done,
    so load drifting over the run biases neither side."""
    blocking, in_save, polls, write_times, step_times, quiet = [], [], [], [], [], []
    for i in range(saves):
        os.sync()
        quiet.extend(loop.step() for _ in range(QUIET_STEPS))
        began = time.perf_counter()
        save(i)
        blocked = time.perf_counter() - began
        in_save.append(blocked)
        polls.append(0)
        deadline = began + timeout
        while True:
            t = time.perf_counter()
            done = poll()
            blocked += time.perf_counter() - t
            polls[-1] += 1
            if done:
                break
            if time.perf_counter() > deadline:
                raise TimeoutError(f"save {i} did not finish within {timeout} s")
            step_times.append(loop.step())
        write_times.append(time.perf_counter() - began)
        blocking.append(blocked)
        os.sync()
        quiet.extend(loop.step() for _ in range(QUIET_STEPS))
    return {"blocking": blocking, "in_save": in_save, "polls": polls, "write": write_times,
            "baseline_step": statistics.median(quiet),
            "step_during": statistics.median(step_times) if step_times else float("nan")}


def copy_floor(state: dict, repeats: int = 5) -> float:
    """Median time to copy the state into warm host buffers with memmoves of 16 MiB spread
    over as many threads as ours uses: the memory-bandwidth floor for any save that keeps
    a consistent snapshot."""
    import concurrent.futures
    import ctypes

    chunk = 16 << 20
    buffers = [torch.empty_like(t) for t in state.values()]
    for dst, src in zip(buffers, state.values()):
        dst.copy_(src)
    jobs = [(dst.data_ptr() + off, src.data_ptr() + off, min(chunk, n - off))
            for dst, src in zip(buffers, state.values())
            for n in [src.numel() * src.element_size()] for off in range(0, n, chunk)]
    times = []
    with concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        for _ in range(repeats):
            began = time.perf_counter()
            for _ in pool.map(lambda job: ctypes.memmove(*job), jobs):
                pass
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def bench_torch_save(state: dict, workdir: str, saves: int, fsync: bool = False) -> list:
    times = []
    for i in range(saves):
        path = os.path.join(workdir, f"torch_save_{i}.pt")
        os.sync()
        began = time.perf_counter()
        torch.save(state, path)
        if fsync:   # durable, as a checkpoint that must survive a node crash
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        times.append(time.perf_counter() - began)
        os.unlink(path)
    return times


def bench_ours(state: dict, workdir: str, saves: int, loop: ComputeLoop, **config) -> dict:
    from nvrx_core.checkpoint import AsyncCheckpointer, CheckpointConfig

    ckpt = AsyncCheckpointer(os.path.join(workdir, "ours"), CheckpointConfig(keep_last=1, **config))
    committed = []

    def save(i):
        ckpt.save(state, i)

    def poll():
        committed.extend(ckpt.finalize())
        return not ckpt.pending_steps

    result = run_async(save, poll, loop, saves)
    ckpt.close()
    shutil.rmtree(os.path.join(workdir, "ours"))
    return result


def bench_dcp(state: dict, workdir: str, saves: int, loop: ComputeLoop) -> dict:
    import torch.distributed.checkpoint as dcp

    futures = {}

    def save(i):
        # no_dist: one rank, so DCP needs no planning collectives.
        futures[i] = dcp.async_save(state, checkpoint_id=os.path.join(workdir, f"dcp_{i}"),
                                    no_dist=True)

    def poll():
        i = max(futures)
        if not futures[i].done():
            return False
        futures[i].result()
        shutil.rmtree(os.path.join(workdir, f"dcp_{i}"))
        return True

    return run_async(save, poll, loop, saves)


def init_single_rank_group() -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


# ---- peer (nvidia-resiliency-ext 0.4.1), run inside the peer venv -------------------------

def peer_worker(gib: float, saves: int, workdir: str) -> dict:
    """Runs under the peer venv's python; prints one JSON line with its measurements."""
    init_single_rank_group()
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
    except ImportError as e:
        return {"error": f"importing nvidia_resiliency_ext.checkpointing fails: {e!r} (its "
                         "checkpointing utils import numpy, which nvidia-resiliency-ext 0.4.1 "
                         "does not declare as a dependency)"}

    state = make_state(gib)
    loop = ComputeLoop()
    report = {}
    try:   # the documented entry point
        documented = TorchAsyncCheckpoint(persistent_queue=True)
        documented.async_save(state, os.path.join(workdir, "peer_documented.pt"))
        documented.finalize_async_save(blocking=True, no_dist=True, terminate=True)
        report["torch_async_checkpoint"] = "ran"
    except Exception as e:  # report whatever stops it on CPU
        report["torch_async_checkpoint"] = f"{type(e).__name__}: {e}"
    # Its queue (persistent worker process) with torch.save works on CPU when called
    # directly. On CPU its preload (.to("cpu")) is a no-op, so the caller must copy
    # the tensors itself or the write races with training: we time that copy too.
    queue = AsyncCallsQueue(persistent=True)
    finished = []

    def save(i):
        snapshot = {k: v.clone() for k, v in state.items()}
        queue.schedule_async_request(AsyncRequest(torch.save, (snapshot, os.path.join(
            workdir, f"peer_{i}.pt")), []))

    def poll():
        finished.extend(queue.maybe_finalize_async_calls(blocking=False, no_dist=True))
        return queue.get_num_unfinalized_calls() == 0

    report.update(run_async(save, poll, loop, saves))
    queue.persistent_caller.close()
    return report


def run_peer(peer_python: str, gib: float, saves: int, workdir: str) -> dict:
    proc = subprocess.run([peer_python, os.path.abspath(__file__), "--peer-worker",
                           "--gib", str(gib), "--saves", str(saves), "--workdir", workdir],
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    return json.loads(lines[-1])


# ---- GPU section ---------------------------------------------------------------------------

def bench_gpu(workdir: str, saves: int) -> None:
    """4 GiB bf16 CUDA state: ours (pinned staging reused) next to DCP async_save."""
    state = make_state(4.0, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    loop = ComputeLoop()
    ours = bench_ours(state, workdir, saves + 1, loop)
    dcp_result = bench_dcp(state, workdir, saves, loop)
    o, d = statistics.median(ours["blocking"]), statistics.median(dcp_result["blocking"])
    print(f"checkpoint_blocking_cuda_4gib: ours {o:.3f} s, peer(dcp.async_save) {d:.3f} s, "
          f"ratio {o / d:.3f}  (ours first save {ours['blocking'][0]:.3f} s allocates pinned "
          f"buffers; acceptance <= 0.25 s: {'PASS' if o <= 0.25 else 'FAIL'})")


# ---- main ----------------------------------------------------------------------------------

def fmt(values: list) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", default=None)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_worker:
        print(json.dumps(peer_worker(args.gib, args.saves, args.workdir)), flush=True)
        return
    workdir = tempfile.mkdtemp(prefix="nvrx-bench-ckpt-", dir="/tmp")
    try:
        run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args, workdir: str) -> None:
    init_single_rank_group()
    state = make_state(args.gib)
    loop = ComputeLoop()
    saves = max(3, args.saves)
    print(f"# {args.gib:g} GiB state ({TENSORS} float32 tensors), {torch.get_num_threads()} "
          f"torch threads, {saves} saves each, workdir {workdir}")
    floor = copy_floor(state)
    ours = bench_ours(state, workdir, saves + 1, loop)   # +1: the first save allocates buffers
    torch_save = bench_torch_save(state, workdir, saves)
    torch_save_durable = bench_torch_save(state, workdir, saves, fsync=True)
    dcp_result = bench_dcp(state, workdir, saves, loop)
    o, t, d = (statistics.median(ours["blocking"]), statistics.median(torch_save),
               statistics.median(dcp_result["blocking"]))
    print(f"# ours blocking per save {fmt(ours['blocking'])} s (first allocates staging buffers; "
          f"in save() {fmt(ours['in_save'])} s, the rest in {ours['polls']} finalize() calls), "
          f"save-to-commit {fmt(ours['write'])} s")
    print(f"# torch.save {fmt(torch_save)} s; dcp.async_save blocking {fmt(dcp_result['blocking'])}"
          f" s, save-to-done {fmt(dcp_result['write'])} s")
    print(f"# torch.save + fsync (durable, as ours is): {fmt(torch_save_durable)} s")
    print(f"# floor: copying the state into warm host buffers (bandwidth bound) takes {floor:.3f} s here")
    print(f"checkpoint_blocking: ours {o:.3f} s, peer(torch.save) {t:.3f} s, ratio {o / t:.3f}")
    print(f"checkpoint_blocking: ours {o:.3f} s, peer(dcp.async_save) {d:.3f} s, ratio {o / d:.3f}")
    so = ours["step_during"] / ours["baseline_step"]
    sd = dcp_result["step_during"] / dcp_result["baseline_step"]
    print(f"checkpoint_step_slowdown: ours {so:.2f}x, peer(dcp.async_save) {sd:.2f}x, "
          f"ratio {so / sd:.3f}  (median step time while the write runs / median step time "
          f"just before: {ours['baseline_step'] * 1e3:.2f} ms, {dcp_result['baseline_step'] * 1e3:.2f} ms)")
    print(f"checkpoint_acceptance: ours <= 10% of torch.save: {'PASS' if o <= 0.1 * t else 'FAIL'}; "
          f"ours <= dcp.async_save: {'PASS' if o <= d else 'FAIL'}")
    del ours, dcp_result
    if args.peer_python:
        peer = run_peer(args.peer_python, args.gib, saves, workdir)
        if "error" in peer:
            print(f"peer(nvrx-0.4.1 async queue): could not run: {peer['error']}")
        else:
            p = statistics.median(peer["blocking"])
            print(f"# nvrx-0.4.1 TorchAsyncCheckpoint.async_save on CPU: "
                  f"{peer['torch_async_checkpoint']}")
            print(f"# nvrx-0.4.1 AsyncCallsQueue (persistent process, torch.save; caller copies "
                  f"the tensors first): blocking {fmt(peer['blocking'])} s, "
                  f"save-to-done {fmt(peer['write'])} s")
            print(f"checkpoint_blocking: ours {o:.3f} s, peer(nvrx-0.4.1 AsyncCallsQueue) "
                  f"{p:.3f} s, ratio {o / p:.3f}")
            sp = peer["step_during"] / peer["baseline_step"]
            print(f"checkpoint_step_slowdown: ours {so:.2f}x, peer(nvrx-0.4.1 AsyncCallsQueue) "
                  f"{sp:.2f}x, ratio {so / sp:.3f}")
    if torch.cuda.is_available():
        bench_gpu(workdir, saves)
    else:
        print("# GPU section skipped: no CUDA device (4 GiB CUDA state, pinned staging)")


if __name__ == "__main__":
    main()
