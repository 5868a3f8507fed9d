"""SIGTERM during real 2-rank DDP training (gloo): the ranks agree, commit a checkpoint,
exit 18; a new run resumes from it and ends with weights identical to a run that was
never interrupted. The signal reaches only rank 1 (as when one node is drained first),
and a second SIGTERM arrives while the checkpoint is being written."""

import json
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist
from harness import wait_for

import warm_python
from harness.stores import host_store

HERE = os.path.abspath(__file__)
TOTAL_STEPS = 150
CHECK_EVERY = 5
SIGNALLED_AT = 20       # run 1's rank 1 waits at this step for the test's SIGTERM


# ---- the training job (rank side) --------------------------------------------------------

def train(ckpt_root: str, out: str) -> None:
    from nvrx_core.checkpoint import AsyncCheckpointer, CheckpointNotFoundError
    from nvrx_core.preemption import DistributedSignalHandler, PreemptionConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["NVRX_TEST_STORE_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = AsyncCheckpointer(ckpt_root)
    handler = DistributedSignalHandler(PreemptionConfig(check_every_n_steps=CHECK_EVERY)).install()
    start = 0
    try:
        step, state = ckpt.load_latest()
        model.module.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = step + 1
    except CheckpointNotFoundError:
        pass
    report = {"resumed_from": start}
    # Run 1's rank 1 waits at SIGNALLED_AT until the test's SIGTERM has arrived, so the job
    # cannot finish before it however late the test sends it (before: a test thread stalled
    # for about a second let the job end first and the test was void).
    hold_at = int(os.environ.get("NVRX_TEST_WAIT_FOR_SIGTERM_AT", -1)) if rank == 1 else -1
    for step in range(start, TOTAL_STEPS):
        batch = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(16, 8, generator=batch)
        loss = (model(x) - x.sum(dim=1, keepdim=True).sin()).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        with open(os.path.join(out, f"progress.rank{rank}"), "w") as f:
            f.write(str(step))
        if step == hold_at:
            wait_for(lambda: handler.signaled, 120, f"the test's SIGTERM to rank {rank} at step {step}")
        if handler.should_stop(step):
            ckpt.save({"model": model.module.state_dict(), "optim": optim.state_dict()}, step)
            open(os.path.join(out, f"saving.rank{rank}"), "w").close()
            deadline = time.monotonic() + 60
            while handler.signaled and len(handler.received) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)   # the test sends its second SIGTERM now, mid-save
            report.update(stopped_at=step, signals=len(handler.received),
                          committed=ckpt.finalize(blocking=True))
            ckpt.close()
            _write_report(out, rank, report)
            handler.exit_preempted()
        time.sleep(0.005)          # leave the test a window to signal mid-training
    ckpt.close()
    torch.save(model.module.state_dict(), os.path.join(out, f"final.rank{rank}.pt"))
    _write_report(out, rank, report)
    dist.destroy_process_group()


def _write_report(out: str, rank: int, report: dict) -> None:
    with open(os.path.join(out, f"report.rank{rank}.json"), "w") as f:
        json.dump(report, f)


# ---- the test side -----------------------------------------------------------------------

def start_job(ckpt_root: str, out: str, events: str, extra_env: dict = None) -> list:
    os.makedirs(out, exist_ok=True)
    store = host_store()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1",
                   NVRX_TEST_STORE_PORT=str(store.port), NVRX_EVENTS_FILE=events, **(extra_env or {}))
        log = open(os.path.join(out, f"rank{rank}.log"), "w")
        procs.append(warm_python.popen([HERE, ckpt_root, out], env=env, stdout=log, stderr=warm_python.STDOUT))
        log.close()
    return procs, store


def finish_job(procs: list, out: str, timeout: float = 120.0) -> list:
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [p.returncode for p in procs]


def rank_log_tails(out: str) -> str:
    """The last lines of both ranks' logs: what a timed-out wait reports."""
    return "".join(open(os.path.join(out, f"rank{r}.log")).read()[-2000:] for r in range(2))


def progress(out: str, rank: int) -> int:
    try:
        with open(os.path.join(out, f"progress.rank{rank}")) as f:
            return int(f.read() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def report(out: str, rank: int) -> dict:
    with open(os.path.join(out, f"report.rank{rank}.json")) as f:
        return json.load(f)


@pytest.mark.timeout(300)
def test_sigterm_commits_exits_18_and_resume_matches_an_uninterrupted_run(tmp_path):
    from nvrx_core.checkpoint import verify_checkpoint
    from nvrx_core.events import read_events

    events = str(tmp_path / "events.jsonl")
    reference = str(tmp_path / "reference")     # the uninterrupted run, alongside run 1
    ref_procs, _ref_store = start_job(str(tmp_path / "ref_ckpt"), reference,
                                      str(tmp_path / "ref_events.jsonl"))
    ckpt_root = str(tmp_path / "ckpt")
    run1 = str(tmp_path / "run1")
    procs, _store = start_job(ckpt_root, run1, events, {"NVRX_TEST_WAIT_FOR_SIGTERM_AT": str(SIGNALLED_AT)})
    wait_for(lambda: progress(run1, 1) >= SIGNALLED_AT, 120, f"training to reach step {SIGNALLED_AT}", details=lambda: rank_log_tails(run1))
    procs[1].send_signal(signal.SIGTERM)                 # only rank 1 is told
    wait_for(lambda: os.path.exists(os.path.join(run1, "saving.rank1")), 60, "the save", details=lambda: rank_log_tails(run1))
    procs[1].send_signal(signal.SIGTERM)                 # again, while the save is in flight
    assert finish_job(procs, run1) == [18, 18]
    assert finish_job(ref_procs, reference) == [0, 0]
    reports = [report(run1, r) for r in range(2)]
    stopped = reports[0]["stopped_at"]
    assert reports[1]["stopped_at"] == stopped and stopped % CHECK_EVERY == 0 and stopped >= SIGNALLED_AT
    assert stopped < TOTAL_STEPS - 1, "the job finished before the signal; test is void"
    assert [r["signals"] for r in reports] == [0, 2]     # rank 0 learnt it from the collective
    assert [r["committed"] for r in reports] == [[stopped], [stopped]]
    assert verify_checkpoint(os.path.join(ckpt_root, f"step_{stopped:010d}")).world_size == 2

    run2 = str(tmp_path / "run2")
    procs, _store = start_job(ckpt_root, run2, events)
    assert finish_job(procs, run2) == [0, 0]
    assert [report(run2, r)["resumed_from"] for r in range(2)] == [stopped + 1] * 2
    for rank in range(2):
        expected = torch.load(os.path.join(reference, f"final.rank{rank}.pt"))
        resumed = torch.load(os.path.join(run2, f"final.rank{rank}.pt"))
        assert expected.keys() == resumed.keys()
        assert all(torch.equal(expected[k], resumed[k]) for k in expected), f"rank {rank} differs"
    kinds = [(e["kind"], e.get("step")) for e in read_events(events)]
    assert ("preemption_agreed", stopped) in kinds and ("checkpoint_committed", stopped) in kinds


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2])
