"""Straggler detection: overhead per step, detection latency, false positives.

    python bench/straggler.py [--peer-python .venv-peer/bin/python] [--runs 5]

- overhead: a sleep-based training step (fwd + bwd sleeps, then a real gloo all_reduce)
  on 2 ranks, run alternately without and with our Detector (see _overhead_worker);
  median of --runs runs of >= 10 s. "peer(no detector)" on those lines is the same step
  without any detector. Reports every 4 s of detected steps (15x the default rate).
- nvidia-resiliency-ext's Detector and ours on the same single-process loop, when the
  peer can run under --peer-python; otherwise the line says why.
- latency: 4 ranks, rank 3's forward becomes 30% slower after report 3; reports and
  seconds until it is flagged (relative and individual scores).
- false positives: 4 ranks, +-20% seeded random jitter on every section, 20 reports.
- CUDA-event timing overhead: only where torch.cuda.is_available().
"""

import argparse
import datetime
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time
from queue import Empty
from typing import Tuple

import torch
import torch.distributed as dist

from nvrx_core.events import EventLog
from nvrx_core.straggler import INDIVIDUAL, RELATIVE, Detector, StragglerConfig

OVERHEAD_REPORT_INTERVAL = 4.0  # 15x the default rate, so every run includes a report


def quiet_config(**kwargs) -> StragglerConfig:
    return StragglerConfig(enable_logging=False, num_scores_to_print=0, **kwargs)


def run_ranks(worker, world: int, params: dict, deadline_s: float = 300.0) -> list:
    """Run worker(rank, world, params) on `world` spawned gloo ranks; rank results in order."""
    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(worker, r, world, store.port, params, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + deadline_s
        while len(results) < world:
            try:
                rank, result = queue.get(timeout=1.0)
                results[rank] = result
            except Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"benchmark ranks failed or hung: {failed or 'deadline passed'}") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]


def _rank_main(worker, rank, world, port, params, queue):
    os.environ.pop("NVRX_EVENTS_FILE", None)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        queue.put((rank, worker(rank, world, params)))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- overhead


def _overhead_worker(rank, world, p):
    """A plain step and a detected step form a pair, in alternating order, so both see the
    same load from the rest of the machine and neither position is favoured. The overhead
    is the median of the paired differences (robust to that load's stalls) plus the
    periodic cost (schedule checks and reports: time inside step() beyond its typical
    cost), amortized per step. step() runs on every other step, so reports every
    2 x OVERHEAD_REPORT_INTERVAL of wall time are every OVERHEAD_REPORT_INTERVAL of
    detected steps."""
    grad = torch.zeros(1024)
    fwd_s, bwd_s = 0.6 * p["step_s"], 0.4 * p["step_s"]

    def plain_step() -> None:
        time.sleep(fwd_s)
        time.sleep(bwd_s)
        dist.all_reduce(grad)

    def detected_step(detector: Detector) -> Tuple[float, bool]:
        with detector.section("fwd"):
            time.sleep(fwd_s)
        with detector.section("bwd"):
            time.sleep(bwd_s)
        with detector.section("grad_sync", kind="wait"):
            dist.all_reduce(grad)
        start = time.perf_counter()
        reported = detector.step() is not None
        return time.perf_counter() - start, reported

    runs = []
    for _ in range(p["runs"]):
        detector = Detector(quiet_config(report_time_interval=2 * OVERHEAD_REPORT_INTERVAL), events=EventLog(None))
        plain, ours, in_step, reports = [], [], [], 0
        dist.barrier()
        for i in range(p["pairs"]):
            for detected in (False, True) if i % 2 == 0 else (True, False):
                start = time.perf_counter()
                if detected:
                    spent, reported = detected_step(detector)
                    in_step.append(spent)
                    reports += reported
                else:
                    plain_step()
                (ours if detected else plain).append(time.perf_counter() - start)
        periodic = (sum(in_step) - statistics.median(in_step) * len(in_step)) / len(in_step)
        extra = statistics.median(o - q for o, q in zip(ours, plain)) + periodic
        plain_s = statistics.median(plain)
        runs.append({"plain": plain_s, "ours": plain_s + extra, "ratio": 1 + extra / plain_s, "periodic": periodic,
                     "reports": reports})
    result = {k: statistics.median(r[k] for r in runs) for k in ("plain", "ours", "ratio", "periodic")}
    result["ratios"] = [r["ratio"] for r in runs]
    result["reports"] = [r["reports"] for r in runs]
    return result


def micro_costs() -> dict:
    """Hot-path cost of one section enter+exit and of one step() between checks (1 process)."""
    detector = Detector(quiet_config(report_time_interval=3600.0), events=EventLog(None))
    section = detector.section("fwd")
    n = 200_000
    start = time.perf_counter()
    for _ in range(n):
        with section:
            pass
    per_section = (time.perf_counter() - start) / n
    detector.step()  # first check; the next is many steps away (1 h interval)
    start = time.perf_counter()
    for _ in range(n):
        detector.step()
    per_step = (time.perf_counter() - start) / n
    return {"section_us": per_section * 1e6, "step_us": per_step * 1e6}


# The single-process loop both detectors run for the side-by-side figure: pairs of a plain
# and a detected step (sleeps only), in alternating order; overhead = median of the paired
# differences + the periodic (report) cost beyond the typical step() call, amortized.
# PEER_LOOP runs it under the peer venv's python and prints one JSON line: {"error": ...}
# when nvidia-resiliency-ext cannot run (it needs its compiled CUPTI extension, libcupti and
# a CUDA device), else {"plain_s", "ratio"}.
SINGLE_LOOP = """
import statistics, time

def overhead(section, step, step_s, pairs):
    plain, detected, in_step = [], [], []
    for i in range(pairs):
        for with_detector in ((False, True) if i % 2 == 0 else (True, False)):
            start = time.perf_counter()
            if with_detector:
                with section("fwd"):
                    time.sleep(0.6 * step_s)
                with section("bwd"):
                    time.sleep(0.4 * step_s)
                before = time.perf_counter()
                step()
                in_step.append(time.perf_counter() - before)
            else:
                time.sleep(0.6 * step_s)
                time.sleep(0.4 * step_s)
            (detected if with_detector else plain).append(time.perf_counter() - start)
    periodic = (sum(in_step) - statistics.median(in_step) * pairs) / pairs
    extra = statistics.median(d - p for d, p in zip(detected, plain)) + periodic
    return statistics.median(plain), 1 + extra / statistics.median(plain)
"""

PEER_LOOP = SINGLE_LOOP + """
import json, sys
step_s, pairs, runs, interval = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
try:
    from nvidia_resiliency_ext.straggler import Detector
    Detector.initialize(report_time_interval=interval, gather_on_rank0=True)
    section = lambda name: Detector.detection_section(name, profile_cuda=False)
    results = [overhead(section, Detector.generate_report_if_interval_elapsed, step_s, pairs) for _ in range(runs)]
    Detector.shutdown()
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
else:
    print(json.dumps({"plain_s": statistics.median(r[0] for r in results),
                      "ratio": statistics.median(r[1] for r in results)}))
"""


def ours_single_process(step_s: float, pairs: int, runs: int) -> dict:
    """Our detector on SINGLE_LOOP, in this process (a world of one)."""
    namespace: dict = {}
    exec(SINGLE_LOOP, namespace)
    results = []
    for _ in range(runs):
        detector = Detector(quiet_config(report_time_interval=2 * OVERHEAD_REPORT_INTERVAL), events=EventLog(None))
        results.append(namespace["overhead"](detector.section, detector.step, step_s, pairs))
    return {"plain_s": statistics.median(r[0] for r in results), "ratio": statistics.median(r[1] for r in results)}


def peer_overhead(peer_python: str, step_s: float, pairs: int, runs: int) -> dict:
    if not peer_python:
        return {"error": "no --peer-python given"}
    cmd = [peer_python, "-c", PEER_LOOP, str(step_s), str(pairs), str(runs), str(2 * OVERHEAD_REPORT_INTERVAL)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"}


# ---------------------------------------------------------------- detection


def _scenario_worker(rank, world, p):
    """fwd/bwd sleeps with seeded jitter, the slow rank's fwd x factor after `inject_after` reports."""
    config = quiet_config(
        report_time_interval=p["interval"], gather_on_rank0=True, warmup_reports=1, consecutive_reports=2
    )
    detector = Detector(config, events=EventLog(None))
    rng = random.Random(p["seed"] + rank)
    jitter, grad = p["jitter"], torch.zeros(64)
    slow = p["slow_factor"] if rank == p["slow_rank"] else 1.0
    flagged, suspected, injected_at, times = [], [], None, {}
    while detector.report_count < p["reports"]:
        injecting = detector.report_count >= p["inject_after"]
        if injecting and injected_at is None:
            injected_at = time.monotonic()
        with detector.section("fwd"):
            time.sleep(p["fwd_s"] * (slow if injecting else 1.0) * (1 + rng.uniform(-jitter, jitter)))
        with detector.section("bwd"):
            time.sleep(p["bwd_s"] * (1 + rng.uniform(-jitter, jitter)))
        with detector.section("grad_sync", kind="wait"):
            dist.all_reduce(grad)
        report = detector.step()
        if report is not None and rank == 0:
            times[report.index] = time.monotonic()
            flagged += [[report.index, s.rank, s.score_kind, s.scope] for s in report.stragglers]
            suspected += [[report.index, s.rank, s.score_kind, s.scope] for s in report.suspects]
    return {"flagged": flagged, "suspected": suspected, "times": times, "injected_at": injected_at}


def detection_latency() -> dict:
    p = dict(interval=1.0, fwd_s=0.010, bwd_s=0.005, jitter=0.0, seed=7, slow_rank=3, slow_factor=1.3)
    p.update(inject_after=3, reports=8)
    rank0 = run_ranks(_scenario_worker, 4, p)[0]
    injected_at = rank0["injected_at"]
    out = {}
    for kind in (RELATIVE, INDIVIDUAL):
        hits = [f[0] for f in rank0["flagged"] if f[1] == 3 and f[2] == kind]
        if hits:
            out[kind] = (hits[0] - p["inject_after"], rank0["times"][hits[0]] - injected_at)
        else:
            out[kind] = None
    out["wrongly_flagged"] = sorted({f[1] for f in rank0["flagged"] if f[1] != 3})
    return out


def false_positives() -> dict:
    p = dict(interval=0.6, fwd_s=0.010, bwd_s=0.005, jitter=0.2, seed=1234, slow_rank=-1, slow_factor=1.0)
    p.update(inject_after=0, reports=20)
    rank0 = run_ranks(_scenario_worker, 4, p)[0]
    return {
        "flagged_reports": len({f[0] for f in rank0["flagged"]}),
        "suspect_reports": len({f[0] for f in rank0["suspected"]}),
    }


# ---------------------------------------------------------------- CUDA


def cuda_event_overhead(runs: int) -> dict:
    """Per-step time of two bf16 matmuls: no detector, CPU-timed sections, CUDA-event sections."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) / 100
    b, c = torch.empty_like(a), torch.empty_like(a)

    def loop(detector, steps=200):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            if detector is None:
                torch.matmul(a, a, out=b)
                torch.matmul(b, a, out=c)
            else:
                with detector.section("fwd"):
                    torch.matmul(a, a, out=b)
                with detector.section("bwd"):
                    torch.matmul(b, a, out=c)
                detector.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    results = {"plain": [], "off": [], "on": []}
    loop(None, 20)  # warm-up: cuBLAS handles, clocks
    for _ in range(runs):
        results["plain"].append(loop(None))
        for mode in ("off", "on"):
            config = quiet_config(report_time_interval=0.5, cuda_timing=mode)
            results[mode].append(loop(Detector(config, events=EventLog(None))))
    return {k: statistics.median(v) for k, v in results.items()}


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-python", default="", help="python of a venv with nvidia-resiliency-ext")
    parser.add_argument("--runs", type=int, default=5, help="runs per overhead figure (median)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    micro = micro_costs()
    print(f"hot_path_section_enter_exit: ours {micro['section_us']:.2f} us, peer n/a (needs CUPTI)")
    print(f"hot_path_step_between_checks: ours {micro['step_us']:.2f} us, peer n/a (needs CUPTI)")
    for step_ms in (5, 50):
        step_s = step_ms / 1e3
        pairs = int(1.3 * OVERHEAD_REPORT_INTERVAL / step_s)  # >= 1.3 report intervals of wall time per run
        result = run_ranks(_overhead_worker, 2, dict(step_s=step_s, pairs=pairs, runs=args.runs))[0]
        ratio = result["ratio"]
        print(
            f"overhead_{step_ms}ms_step (2 gloo ranks, {pairs} step pairs x {args.runs} runs, "
            f"reports/run {result['reports']}, run ratios {' '.join(f'{r:.4f}' for r in result['ratios'])}): "
            f"ours {result['ours'] * 1e3:.3f} ms, peer(no detector) {result['plain'] * 1e3:.3f} ms, "
            f"ratio {ratio:.4f} ({(ratio - 1) * 100:+.2f}%; checks+reports {result['periodic'] * 1e6:.1f} us/step)",
            flush=True,
        )
        peer = peer_overhead(args.peer_python, step_s, pairs, args.runs)
        if "error" in peer:
            print(f"nvrx_peer_overhead_{step_ms}ms_step: peer(nvidia-resiliency-ext) cannot run here: {peer['error']}")
        else:
            ours = ours_single_process(step_s, pairs, args.runs)
            print(
                f"nvrx_peer_overhead_{step_ms}ms_step (1 process, step time with / without each detector): "
                f"ours {ours['ratio']:.4f}, peer(nvidia-resiliency-ext) {peer['ratio']:.4f}, "
                f"ratio {ours['ratio'] / peer['ratio']:.4f}"
            )

    latency = detection_latency()
    for kind in (RELATIVE, INDIVIDUAL):
        hit = latency[kind]
        text = f"{hit[0]} reports ({hit[1]:.2f} s after the slowdown began)" if hit else "NOT flagged"
        print(f"detection_latency_30pct_{kind} (4 ranks, 1 s reports): ours {text}, peer n/a (needs CUPTI/GPU)")
    print(f"wrongly_flagged_ranks_in_latency_run: ours {latency['wrongly_flagged'] or 'none'}")
    fp = false_positives()
    print(
        f"false_positives_20_reports_jitter20pct (4 ranks): ours {fp['flagged_reports']} reports with a flagged rank "
        f"({fp['suspect_reports']} with a single bad score, absorbed by hysteresis), peer n/a"
    )

    if torch.cuda.is_available():
        cuda = cuda_event_overhead(args.runs)
        for mode in ("off", "on"):
            print(
                f"cuda_timing_{mode}_overhead (2 bf16 8192^2 matmuls per step): ours {cuda[mode] * 1e3:.3f} ms, "
                f"peer(no detector) {cuda['plain'] * 1e3:.3f} ms, ratio {cuda[mode] / cuda['plain']:.4f}"
            )
    else:
        print("cuda_timing_overhead: skipped (torch.cuda.is_available() is False on this machine)")


if __name__ == "__main__":
    sys.exit(main())
