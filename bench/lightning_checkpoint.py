"""Benchmark: how long a ModelCheckpoint save blocks a Lightning training loop, with
NVRxAsyncCheckpointIO, Lightning's AsyncCheckpointIO and the default TorchCheckpointIO.

    .venv/bin/python bench/lightning_checkpoint.py [--gib 1.0] [--saves 4] [--runs 2] [--every 4]
                                                   [--save-top-k 1]

Same run, same model: LAYERS bias-free Linear(WIDTH, WIDTH) float32 layers (1 GiB of
weights), batch 4, SGD without momentum (the optimizer holds no state), a real
Trainer(accelerator="cpu", devices=1) with ModelCheckpoint(every_n_train_steps=every,
save_top_k=1): each save also removes the previous checkpoint, through the plugin (ours
takes the name away with a rename and frees the bytes in the background; the peers delete
on the loop). --save-top-k -1 keeps every checkpoint: the save alone.

Blocked per save = the wall time of ModelCheckpoint.on_train_batch_end on a step that
saves: Lightning's dump_checkpoint, the plugin's save_checkpoint, the removal of the
previous checkpoint and the barrier, i.e. everything the loop waits for before its next
step. Before each save step (untimed) the previous save is waited for and os.sync() run,
so every save starts with no write of another in flight and no dirty page-cache backlog.
Each method runs `runs` times in a fresh process, interleaved (ours, async, torch, ours,
...), so load drifting over the run biases none; the first save of each process is printed
apart (ours allocates its staging buffers there) and the medians are over the others.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from _process import run_group

LAYERS, WIDTH, BATCH = 4, 8192, 4
METHODS = ("ours", "async", "torch")
WORKER_LIMIT_S = 900.0


def worker(method: str, gib: float, saves: int, every: int, top_k: int, workdir: str) -> dict:
    """One Trainer.fit in this process; returns the blocked time of each save."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nvrx_lightning._compat import LightningModule, Trainer, pl
    from nvrx_lightning.checkpoint_io import NVRxAsyncCheckpointIO

    layers = max(1, round(gib * (1 << 30) / (WIDTH * WIDTH * 4)))

    class BigModel(LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                             for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    io = {"ours": NVRxAsyncCheckpointIO, "async": pl.plugins.io.AsyncCheckpointIO,
          "torch": pl.plugins.io.TorchCheckpointIO}[method]()
    timings = []

    def drain() -> None:
        """Untimed: the previous save is written (each IO's own way of knowing)."""
        if method == "ours" and io._checkpointer is not None:
            io._checkpointer.finalize(blocking=True)
        elif method == "async" and io._executor is not None:
            io._executor.submit(lambda: None).result()   # one worker: runs after the save

    class TimedCheckpoint(pl.callbacks.ModelCheckpoint):
        def on_train_batch_start(self, trainer, *args, **kwargs):
            if (trainer.global_step + 1) % every == 0:
                drain()
                os.sync()

        def on_train_batch_end(self, trainer, *args, **kwargs):
            began = time.perf_counter()
            super().on_train_batch_end(trainer, *args, **kwargs)
            if trainer.global_step % every == 0:
                timings.append(time.perf_counter() - began)

    steps = saves * every
    data = torch.randn(steps * BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, default_root_dir=workdir, plugins=[io],
                      callbacks=[TimedCheckpoint(dirpath=os.path.join(workdir, "ckpt"),
                                                 every_n_train_steps=every, save_top_k=top_k)])
    began = time.perf_counter()
    trainer.fit(BigModel(), DataLoader(TensorDataset(data), batch_size=BATCH))
    return {"method": method, "blocked": timings, "fit_s": time.perf_counter() - began,
            "layers": layers, "threads": torch.get_num_threads()}


def run_worker(method: str, args, workdir: str, log_path: str) -> dict:
    out = os.path.join(workdir, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, "--gib", str(args.gib),
           "--saves", str(args.saves), "--every", str(args.every),
           "--save-top-k", str(args.save_top_k), "--workdir", workdir,
           "--out", out]
    with open(log_path, "w") as log:
        code = run_group(cmd, log, dict(os.environ), WORKER_LIMIT_S)
    if code != 0 or not os.path.exists(out):
        with open(log_path) as log:
            tail = log.read()[-3000:]
        raise RuntimeError(f"{method} worker failed (exit {code}):\n{tail}")
    with open(out) as f:
        return json.load(f)


def fmt(values: list) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=4, help="saves per process (the first is apart)")
    parser.add_argument("--runs", type=int, default=2, help="processes per method, interleaved")
    parser.add_argument("--every", type=int, default=4, help="steps between saves")
    parser.add_argument("--save-top-k", type=int, default=1, help="ModelCheckpoint's save_top_k")
    parser.add_argument("--peer-python", default=None, help="unused: the peers are Lightning's own")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args.worker, args.gib, max(2, args.saves), args.every, args.save_top_k,
                        args.workdir)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return
    root = tempfile.mkdtemp(prefix="nvrx-bench-lckpt-", dir="/tmp")
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args, root: str) -> None:
    results = {m: [] for m in METHODS}
    for run_index in range(max(1, args.runs)):
        for method in METHODS:
            workdir = os.path.join(root, f"{method}{run_index}")
            os.makedirs(workdir)
            try:
                results[method].append(run_worker(method, args, workdir, os.path.join(root, f"{method}{run_index}.log")))
            finally:
                shutil.rmtree(os.path.join(workdir, "ckpt"), ignore_errors=True)
    first = results["ours"][0]
    print(f"# {args.gib:g} GiB model ({first['layers']} x Linear({WIDTH}, {WIDTH}) float32), batch "
          f"{BATCH}, SGD; ModelCheckpoint(every_n_train_steps={args.every}, "
          f"save_top_k={args.save_top_k}); "
          f"{max(2, args.saves)} saves per process, {max(1, args.runs)} processes per method, "
          f"{first['threads']} torch threads, {os.cpu_count()} CPUs")
    medians = {}
    for method, label in (("ours", "NVRxAsyncCheckpointIO"), ("async", "AsyncCheckpointIO"),
                          ("torch", "TorchCheckpointIO")):
        firsts = [r["blocked"][0] for r in results[method]]
        rest = [t for r in results[method] for t in r["blocked"][1:]]
        medians[method] = statistics.median(rest)
        print(f"# {label}: blocked per save {fmt(rest)} s (median {medians[method]:.3f}); first save "
              f"of each process {fmt(firsts)} s; fit {fmt([r['fit_s'] for r in results[method]])} s")
    o, a, t = medians["ours"], medians["async"], medians["torch"]
    print(f"lightning_ckpt_blocking_vs_async: ours {o:.3f} s, peer {a:.3f} s, ratio {o / a:.3f}")
    print(f"lightning_ckpt_blocking_vs_torch: ours {o:.3f} s, peer {t:.3f} s, ratio {o / t:.3f}")
    print(f"lightning_ckpt_acceptance: <= 0.25x AsyncCheckpointIO {'PASS' if o <= 0.25 * a else 'FAIL'}, "
          f"<= 0.1x TorchCheckpointIO {'PASS' if o <= 0.1 * t else 'FAIL'}")


if __name__ == "__main__":
    main()
