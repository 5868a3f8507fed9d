"""Straggler detection on real gloo process groups: 4 (or 2) spawned processes each.

Which rank is slow, its scores, who waits for whom and when it is flagged are decided on
recorded timings (harness.timeline): each rank's detector reads a FakeClock, as both its
schedule clock and its section timer, that a section advances by the duration the test gives
it, and a collective ends, on every rank, when the last rank arrived (a real all_reduce MAX
of the arrival times), as data-parallel training waits for its slowest rank.
The exchange, the scoring, the flags, rank 0's decision shared with the others and the stop
all run for real; the scores are exact (1/k), whatever the host's load.

One test runs on the host's real clock, end to end (sleeps, perf_counter, a wrapped
torch.distributed.all_reduce); it decides no ranking, and asserts only what a load cannot
falsify: each rank's timed forward is at least what it slept (test_real_sleeps_...).
"""

import datetime
import functools
import json
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from harness.clock import FakeClock
from harness.ranks import spawn_ranks
from harness.timeline import all_arrive
from nvrx_core.durable import atomic_write_json
from nvrx_core.events import EVENTS_FILE_ENV, STRAGGLER_FOUND, read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.report import attribution
from nvrx_core.report.attribution import attribute
from nvrx_core.report.plot import straggler_matrix
from nvrx_core.straggler import INDIVIDUAL, OVERALL, RELATIVE, Detector, StragglerConfig

# ---------------------------------------------------------------- harness


def _rank_main(worker, rank, world, port, out_dir, params):
    os.environ["RANK"] = str(rank)
    if params.get("events_file"):
        os.environ[EVENTS_FILE_ENV] = params["events_file"]
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        result = worker(rank, world, out_dir, params)
        atomic_write_json(os.path.join(out_dir, f"rank{rank}.json"), result)
    finally:
        dist.destroy_process_group()


def run_ranks(worker, world, out_dir, params, deadline_s=100.0):
    """Run worker on `world` spawned ranks; returns (exit codes, per-rank results or None)."""
    exits = spawn_ranks(functools.partial(_rank_main, worker), world, str(out_dir), (params,), deadline_s)
    results = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    return exits, results


def _summary(report):
    def by_rank(table):
        return {scope: {str(r): s for r, s in scores.items()} for scope, scores in table.items()}

    return {
        "index": report.index,
        "complete": report.complete,
        "flagged_ranks": list(report.flagged_ranks),
        "stragglers": [[s.rank, s.score_kind, s.scope, s.score, s.consecutive] for s in report.stragglers],
        "suspects": [[s.rank, s.score_kind, s.scope] for s in report.suspects],
        "relative": by_rank(report.relative),
        "individual": by_rank(report.individual),
        "wait_ms": {str(r): s.wait_ms for r, s in report.ranks.items()},
        "fwd_ms": {str(r): s.section_ms.get("fwd") for r, s in report.ranks.items()},
        "waited_for": report.waited_for,
        "stop": report.stop,
    }


def _recorded_worker(rank, world, out_dir, p):
    """fwd and bwd of the recorded durations (fwd `slow` times longer on some ranks once
    `inject_after` reports were made; seeded jitter), then the gradients' all_reduce."""
    hook_calls = []

    def checkpoint_hook(report):
        hook_calls.append(report.index)
        atomic_write_json(os.path.join(out_dir, f"checkpoint{rank}.json"),
                          {"report": report.index, "flagged": list(report.flagged_ranks)})

    clock = FakeClock()
    detector = Detector(StragglerConfig(**p["config"]), checkpoint_hook=checkpoint_hook, clock=clock, timer=clock)
    rng = random.Random(p.get("seed", 0) + rank)
    jitter = p.get("jitter", 0.0)
    slow = p.get("slow", {}).get(str(rank), 1.0)
    reports, steps = [], 0
    while detector.report_count < p["reports"] and steps < p["max_steps"]:
        factor = slow if detector.report_count >= p.get("inject_after", 0) else 1.0
        with detector.section("fwd"):
            clock.advance(p["fwd_s"] * factor * (1 + rng.uniform(-jitter, jitter)))
        with detector.section("bwd"):
            clock.advance(p["bwd_s"] * (1 + rng.uniform(-jitter, jitter)))
        with detector.section("grad_sync", kind="wait"):
            all_arrive(clock)
        report = detector.step()
        steps += 1
        if report is not None:
            reports.append(_summary(report))
    detector.close()
    return {"reports": reports, "steps": steps, "hook_calls": hook_calls}


def _first_flag(reports, rank, kind, scope):
    for rep in reports:
        if any(s[0] == rank and s[1] == kind and s[2] == scope for s in rep["stragglers"]):
            return rep["index"]
    return None


# ---------------------------------------------------------------- tests on recorded timings

BASE_CONFIG = dict(
    report_time_interval=0.6,
    warmup_reports=1,
    consecutive_reports=2,
    num_scores_to_print=0,
    enable_logging=False,
)


@pytest.mark.timeout(150)
def test_slow_ranks_flagged_at_the_second_slow_report_with_scores_one_over_k(tmp_path):
    """Rank 2's forward becomes 1.5x and rank 3's 2.5x slower after report 3 of 7: both are
    suspects at report 4, flagged at report 5 (consecutive_reports=2), scored exactly 1/k,
    and everyone else waits for rank 3 in the all_reduce."""
    inject_after = 3
    params = dict(
        config=dict(BASE_CONFIG, gather_on_rank0=True, report_time_interval=0.8),
        fwd_s=0.050,
        bwd_s=0.005,
        slow={"2": 1.5, "3": 2.5},
        inject_after=inject_after,
        reports=7,
        max_steps=3000,
    )
    codes, results = run_ranks(_recorded_worker, 4, tmp_path, params)
    assert codes == [0, 0, 0, 0]
    reports = results[0]["reports"]
    assert [r["index"] for r in reports] == list(range(1, 8))
    assert all(r["complete"] for r in reports)
    before, after = reports[:inject_after], reports[inject_after:]
    assert not any(r["stragglers"] or r["suspects"] for r in before), before
    assert {s[0] for s in after[0]["suspects"]} == {2, 3} and not after[0]["stragglers"], after[0]
    for rank in (2, 3):
        for kind in (RELATIVE, INDIVIDUAL):
            for scope in ("fwd", OVERALL):
                assert _first_flag(reports, rank, kind, scope) == inject_after + 2, (rank, kind, scope, reports)
    assert {s[0] for r in reports for s in r["stragglers"]} == {2, 3}, reports
    for rep in after:
        for kind in ("relative", "individual"):
            fwd = rep[kind]["fwd"]
            assert fwd == pytest.approx({"0": 1.0, "1": 1.0, "2": 1 / 1.5, "3": 1 / 2.5}, abs=1e-9), (kind, rep)
    # The all_reduce ends when rank 3 arrives: ranks 0 and 1 wait 75 ms a step, rank 2 50 ms,
    # rank 3 only the reduction itself. Before the slowdown nobody waits for anybody.
    for rep in after:
        assert rep["wait_ms"] == pytest.approx({"0": 76.0, "1": 76.0, "2": 51.0, "3": 1.0}, abs=1e-6), rep
    assert [rep["waited_for"] for rep in reports] == [None] * inject_after + [3] * len(after)
    # Other ranks only learn who is flagged (gather_on_rank0).
    for rank in (1, 2, 3):
        other = results[rank]["reports"]
        assert [r["index"] for r in other] == list(range(1, 8))
        assert not any(r["complete"] for r in other)
        assert [r["flagged_ranks"] for r in other] == [r["flagged_ranks"] for r in reports]


@pytest.mark.timeout(150)
def test_no_false_positive_over_20_reports_with_jitter(tmp_path):
    """+-20% seeded random jitter on every section of every step of every rank, no slowdown,
    the core's default thresholds (0.8): the per-report medians absorb it."""
    params = dict(
        config=dict(BASE_CONFIG, gather_on_rank0=False, report_time_interval=1.0),
        fwd_s=0.010,
        bwd_s=0.005,
        jitter=0.2,
        seed=1234,
        reports=20,
        max_steps=4000,
    )
    codes, results = run_ranks(_recorded_worker, 4, tmp_path, params)
    assert codes == [0, 0, 0, 0]
    for rank, result in enumerate(results):
        reports = result["reports"]
        assert len(reports) == 20 and all(r["complete"] for r in reports)
        bad = [(r["index"], r["stragglers"]) for r in reports if r["stragglers"] or r["flagged_ranks"]]
        assert not bad, f"false positives on rank {rank}: {bad}"
        # every rank computed the same report (gather_on_rank0=False)
        assert [r["relative"] for r in reports] == [r["relative"] for r in results[0]["reports"]]
    scores = sorted(
        s for r in results[0]["reports"] for kind in ("relative", "individual") for t in r[kind].values() for s in t.values()
    )
    assert len(scores) > 20 * 4 * 3  # relative and individual scores of 3 scopes were computed
    assert scores[len(scores) // 2] > 0.93, f"healthy ranks score low: median {scores[len(scores) // 2]:.3f}"


@pytest.mark.timeout(150)
def test_stop_if_detected_checkpoints_then_exits_19(tmp_path):
    """Rank 3 is 2x slower from the start: bad from report 1, flagged at report 2, where every
    rank runs the checkpoint hook and exits 19; the events make `nvrx report` name rank 3."""
    events_file = str(tmp_path / "events.jsonl")
    params = dict(
        config=dict(BASE_CONFIG, report_time_interval=0.4, stop_if_detected=True, gather_on_rank0=True),
        fwd_s=0.006,
        bwd_s=0.003,
        slow={"3": 2.0},
        reports=30,
        max_steps=4000,
        events_file=events_file,
    )
    codes, results = run_ranks(_recorded_worker, 4, tmp_path, params)
    assert codes == [int(ExitCode.STRAGGLER_STOP)] * 4
    assert results == [None] * 4  # no rank went on training after the stop
    for rank in range(4):
        checkpoint = json.load(open(tmp_path / f"checkpoint{rank}.json"))
        assert checkpoint == {"report": 2, "flagged": [3]}
    found = [e for e in read_events(events_file) if e["kind"] == STRAGGLER_FOUND]
    assert found and {e["straggler_rank"] for e in found} == {3}
    assert all(e["action"] == "stop" and e["rank"] == 0 for e in found)
    verdict = attribute(read_events(events_file))  # what `nvrx report` says of this stop
    assert (verdict.kind, verdict.culprits) == (attribution.STRAGGLER, [3])
    ranks, reports, cells = straggler_matrix(read_events(events_file))  # the report's heatmap
    assert ranks == [0, 1, 2, 3] and len(reports) >= 2
    assert min(cells, key=cells.get)[0] == 3  # the lowest score of any report is rank 3's
    assert {(e["score_kind"], e["scope"]) for e in found} >= {(RELATIVE, "fwd"), (RELATIVE, OVERALL)}


def _control_worker(rank, world, out_dir, p):
    """Detection starts disabled by the control file; rank 0 enables it after report 2."""
    clock = FakeClock()
    detector = Detector(StragglerConfig(**p["config"]), clock=clock, timer=clock)
    observed = []
    while detector.report_count < 5:
        with detector.section("fwd"):
            clock.advance(0.003)
        with detector.section("sync", kind="wait"):
            all_arrive(clock)
        report = detector.step()
        if report is not None or detector.report_count > len(observed):
            observed.append(
                [detector.report_count, report is not None, detector.config.enabled, detector.config.relative_perf_threshold]
            )
            if rank == 0 and detector.report_count == 2:
                with open(p["config"]["control_file"], "w") as f:
                    f.write("enabled: true\nrelative_perf_threshold: 0.9\n")
    return {"observed": observed}


@pytest.mark.timeout(120)
def test_control_file_switches_every_rank_at_the_same_report(tmp_path):
    control = tmp_path / "control.yaml"
    control.write_text("enabled: false\n")
    params = dict(config=dict(BASE_CONFIG, report_time_interval=0.25, control_file=str(control)))
    codes, results = run_ranks(_control_worker, 2, tmp_path, params)
    assert codes == [0, 0]
    expected = [
        [1, False, False, 0.8],
        [2, False, False, 0.8],
        [3, False, True, 0.9],  # read the file: enabled from here, but nothing timed yet
        [4, True, True, 0.9],
        [5, True, True, 0.9],
    ]
    assert results[0]["observed"] == expected
    assert results[1]["observed"] == expected


# ---------------------------------------------------------------- end to end on the host's clock


def _real_time_worker(rank, world, out_dir, p):
    """Sleeps timed by perf_counter, then torch.distributed.all_reduce, wrapped by the detector."""
    detector = Detector(StragglerConfig(**p["config"]))
    detector.wrap_attribute(dist, "all_reduce", kind="wait")
    slow = p["slow"].get(str(rank), 1.0)
    grad = torch.zeros(64)
    reports = []
    while detector.report_count < p["reports"]:
        factor = slow if detector.report_count >= p["inject_after"] else 1.0
        with detector.section("fwd"):
            time.sleep(p["fwd_s"] * factor)
        dist.all_reduce(grad)
        report = detector.step()
        if report is not None:
            reports.append(_summary(report))
    wrapped = "all_reduce" in vars(dist) and dist.all_reduce is not torch.distributed.distributed_c10d.all_reduce
    detector.close()
    restored = dist.all_reduce is torch.distributed.distributed_c10d.all_reduce
    return {"reports": reports, "wrapped": wrapped, "restored": restored}


@pytest.mark.timeout(150)
def test_real_sleeps_and_a_wrapped_all_reduce_are_timed_on_the_hosts_clock(tmp_path):
    """The wiring on the host's own clock: perf_counter, real sleeps, the detector timing
    torch.distributed.all_reduce by wrapping it (and unwrapping it at close), rank 0's report
    reaching every rank. Which rank is a straggler is decided on recorded timings (the tests
    above); here only what a loaded host cannot falsify is asserted: a sleep never ends early,
    so every rank's median forward is at least what it slept (rank 3's 10x after report 2),
    and the wrapped collective was timed on every rank in every report."""
    inject_after = 2
    params = dict(
        config=dict(BASE_CONFIG, gather_on_rank0=True, report_time_interval=0.8,
                    relative_perf_threshold=0.3, individual_perf_threshold=0.3),
        fwd_s=0.010,
        slow={"3": 10.0},
        inject_after=inject_after,
        reports=inject_after + 4,
    )
    codes, results = run_ranks(_real_time_worker, 4, tmp_path, params)
    assert codes == [0, 0, 0, 0]
    assert all(r["wrapped"] and r["restored"] for r in results)
    reports = results[0]["reports"]
    assert [r["index"] for r in reports] == list(range(1, inject_after + 5))
    for report in reports[inject_after + 1:]:  # every step of these was slowed on rank 3
        slept = {rank: 10.0 * (10 if rank == 3 else 1) for rank in range(4)}
        assert all(report["fwd_ms"][str(rank)] >= ms for rank, ms in slept.items()), report["fwd_ms"]
    assert all(report["wait_ms"][str(rank)] is not None for report in reports for rank in range(4))
    for rank in (1, 2, 3):  # rank 0's decision reached every rank
        assert [r["flagged_ranks"] for r in results[rank]["reports"]] == [r["flagged_ranks"] for r in reports]
