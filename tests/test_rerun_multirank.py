"""The rerun protocol on two real ranks (gloo): one rank's suspicion makes every rank rerun.

Each rank is a real process running tests/test_rerun_worker.py, which all-reduces the
gradients inside the step: if the ranks disagreed on whether to rerun, they would hang in
that all-reduce instead of passing. "Another device" is SIMULATED by giving rank 0 a
different injected DeviceIdentity when it resumes.
"""

import json
from pathlib import Path
from typing import List

import pytest

from nvrx_core.rerun import read_rejected_results

import warm_python
from harness.ranks import TorchrunLikeRanks

WORKER = Path(__file__).with_name("test_rerun_worker.py")

pytestmark = pytest.mark.timeout(150)


def run_ranks(out: Path, tag: str, *args: str) -> List[dict]:
    """Both ranks of the worker with torchrun's environment (harness.ranks.TorchrunLikeRanks),
    their logs in out/logs-<tag>; each rank's result file, checked against its exit code."""
    ranks = TorchrunLikeRanks(str(out / f"logs-{tag}"), [str(WORKER), "--out", str(out), "--tag", tag, *args],
                              preload=warm_python.TORCH, world=2)
    codes = ranks.finish(timeout=120)
    results = []
    for rank, code in enumerate(codes):
        result_file = out / f"result-{tag}-rank{rank}.json"
        assert result_file.exists(), f"rank {rank} ({tag}) left no result, rc {code}:\n{ranks.logs()}"
        result = json.loads(result_file.read_text())
        assert code == result["exit_code"], ranks.logs()
        results.append(result)
    return results


def test_transient_error_on_rank1_makes_both_ranks_rerun_and_exit_17(tmp_path):
    ranks = run_ranks(tmp_path, "t", "--steps", "3", "--inject-at-step", "2", "--inject-rank", "1",
                      "--inject-type", "transient_error")
    assert [r["exit_code"] for r in ranks] == [17, 17]
    assert [r["runs"] for r in ranks] == [{"1": 1, "2": 2}] * 2  # rank 0 reran too
    assert [r["diagnoses"] for r in ranks] == [[], ["transient_error"]]
    records = read_rejected_results(str(tmp_path / "rejected.jsonl"))
    assert {(r.rank, r.status) for r in records} == {(1, "initial_run"), (1, "first_rerun_not_reproducible")}


def test_persistent_error_on_rank0_checkpoints_both_ranks_and_resumes_elsewhere(tmp_path):
    inject = ["--inject-at-step", "3", "--inject-rank", "0", "--inject-type", "persistent_error"]
    first = run_ranks(tmp_path, "first", "--identity", "node-a/cpu:0,node-a/cpu:1", *inject)
    assert [r["exit_code"] for r in first] == [16, 16]
    assert [r["runs"]["3"] for r in first] == [2, 2]
    assert (tmp_path / "ckpt-rank0.pt").exists() and (tmp_path / "ckpt-rank1.pt").exists()

    # Resume with rank 0 on a different (simulated) device; rank 1 where it was.
    moved = run_ranks(tmp_path, "moved", "--resume", "--identity", "node-b/cpu:0,node-a/cpu:1")
    assert [r["exit_code"] for r in moved] == [0, 0]
    assert [r["runs"] for r in moved] == [{"3": 1, "4": 1, "5": 1, "6": 1}] * 2
    assert [r["diagnoses"] for r in moved] == [["persistent_error"], []]
    assert moved[0]["param_sum"] == moved[1]["param_sum"]  # the ranks still train in lockstep
    assert moved[0]["losses"].keys() == {"3", "4", "5", "6"}


def test_determinism_stats_are_gathered_to_rank0(tmp_path):
    ranks = run_ranks(tmp_path, "s", "--steps", "4", "--mode", "report_determinism_stats",
                      "--stats-interval", "2", "--noise-rank", "1")
    assert [r["exit_code"] for r in ranks] == [0, 0]
    assert [r["runs"] for r in ranks] == [{str(s): 2 for s in range(1, 5)}] * 2
    report = ranks[0]["stats"]
    assert ranks[1]["stats"] is None
    assert report["iteration"] == 4 and report["world_size"] == 2
    loss = report["calls"]["NaN/Inf loss"]
    assert loss["count"] == 4  # 2 steps since the report at iteration 2, x 2 ranks
    assert loss["max"] > 0 and loss["max_rank"] == 1  # only rank 1 has a noise source
    assert loss["p50"] <= loss["p90"] <= loss["p99"] <= loss["max"]
