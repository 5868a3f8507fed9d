"""Checkpointing across real gloo ranks: the global commit protocol, an overlapped save
dropped on every rank when one rank modified its state too early, local find_latest
agreement, restoring a lost node from peer replicas, the fallback to the persistent
checkpoint, collectives that never leave their tensors to a backend thread, and a save
still in flight when the process exits without close(). Each scenario runs as separate
processes (this file run as a script).
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import warm_python
from harness.stores import host_store

HERE = os.path.abspath(__file__)


# ---- launcher (test side) ----------------------------------------------------------------

def launch(scenario: str, world_size: int, args: dict, timeout: float = 150.0) -> list:
    """Run `scenario` on `world_size` real processes joined by a gloo process group;
    returns each rank's result JSON. The test process hosts the rendezvous store."""
    store = host_store()
    out = args["out"]
    os.makedirs(out, exist_ok=True)
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                   NVRX_TEST_STORE_PORT=str(store.port), OMP_NUM_THREADS="1")
        log = open(os.path.join(out, f"{scenario}.rank{rank}.log"), "w")
        procs.append((warm_python.popen([HERE, scenario, json.dumps(args)],
                                        env=env, stdout=log, stderr=warm_python.STDOUT), log))
    deadline = time.monotonic() + timeout
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    codes = [proc.returncode for proc, _ in procs]
    if any(codes):
        logs = "".join(open(os.path.join(out, f"{scenario}.rank{r}.log")).read()[-3000:]
                       for r in range(world_size))
        pytest.fail(f"{scenario}: exit codes {codes}\n{logs}")
    results = []
    for rank in range(world_size):
        with open(os.path.join(out, f"{scenario}.rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


# ---- scenarios (rank side) ---------------------------------------------------------------

def rank_state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(300, generator=gen), "meta": {"rank": rank, "step": step}}


def same_state(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and a["meta"] == b["meta"]


def node_root(args: dict, rank: int) -> str:
    return os.path.join(args["base"], "local", f"node{rank // 2}")


def scenario_global(args: dict, rank: int, world: int) -> dict:
    from nvrx_core.checkpoint import AsyncCheckpointer, read_manifest

    root = os.path.join(args["base"], "global")
    ckpt = AsyncCheckpointer(root)
    for step in (1, 2):
        ckpt.save(rank_state(rank, step), step)
        ckpt.finalize(blocking=True)
    manifest = read_manifest(ckpt.store.path(2)).to_json()
    dist.barrier()
    if rank == 0:   # damage rank 1's shard of the newest step
        path = os.path.join(ckpt.store.path(2), "rank_00001.data0")
        with open(path, "r+b") as f:
            f.seek(17)
            byte = f.read(1)
            f.seek(17)
            f.write(bytes([byte[0] ^ 0x5A]))
    dist.barrier()
    step, state = ckpt.load_latest()
    # a disk problem on rank 1 only: its data file's path is taken by a directory
    from nvrx_core.checkpoint import CheckpointSaveError
    from nvrx_core.checkpoint.layout import partial_dir_name

    if rank == 1:
        os.makedirs(os.path.join(root, partial_dir_name(3, ckpt.run_id, 3), "rank_00001.data0"))
    ckpt.save(rank_state(rank, 3), 3)
    try:
        ckpt.finalize(blocking=True)
        save_error = None
    except CheckpointSaveError as e:
        save_error = str(e)
    dist.barrier()
    ckpt.close()
    return {"manifest": manifest, "loaded_step": step,
            "loaded_ok": same_state(state, rank_state(rank, step)), "save_error": save_error,
            "dirs_after_failure": sorted(os.listdir(root))}


def scenario_overlapped_modified_on_one_rank(args: dict, rank: int, world: int) -> dict:
    """Overlapped staging; at step 2 rank 1 updates its weights before wait_staged()."""
    from nvrx_core.checkpoint import (AsyncCheckpointer, CheckpointConfig, CheckpointSaveError,
                                      SnapshotModifiedError)

    root = os.path.join(args["base"], "global")
    ckpt = AsyncCheckpointer(root, CheckpointConfig(staging="overlapped"))
    errors = {}
    for step in (1, 2, 3):
        state = rank_state(rank, step)
        ckpt.save(state, step)
        if rank == 1 and step == 2:
            state["w"].add_(1.0)              # the bug: before wait_staged()
        try:
            ckpt.wait_staged()
            ckpt.finalize(blocking=True)
        except SnapshotModifiedError as e:
            errors[step] = f"SnapshotModifiedError: {e}"
            ckpt.finalize(blocking=True)      # the dropped save is not raised a second time
        except CheckpointSaveError as e:
            errors[step] = f"CheckpointSaveError: {e}"
        state["w"].add_(1.0)                  # training goes on
    dist.barrier()
    step, loaded = ckpt.load_latest()
    ckpt.close()
    return {"errors": errors, "steps": ckpt.store.steps(), "leftovers": sorted(
        n for n in os.listdir(root) if n.startswith(".")), "loaded_step": step,
        "loaded_ok": same_state(loaded, rank_state(rank, step))}


def scenario_local_find_latest(args: dict, rank: int, world: int) -> dict:
    from nvrx_core.checkpoint import LocalCheckpointConfig, LocalCheckpointManager

    manager = LocalCheckpointManager(node_root(args, rank), LocalCheckpointConfig(keep_last=5))
    for step in (10, 20, 30):
        if rank == 2 and step == 30:
            continue   # rank 2 never got step 30 (e.g. it failed before the save)
        manager.save(rank_state(rank, step), step)
        manager.finalize(blocking=True)
    own_steps = manager.store.steps()
    latest = manager.find_latest()
    loaded = manager.load()
    manager.close()
    return {"own_steps": own_steps, "latest": latest, "loaded_step": loaded.step,
            "source": loaded.source, "loaded_ok": same_state(loaded.state, rank_state(rank, 20))}


def _managers(args: dict, rank: int):
    from nvrx_core.checkpoint import (AsyncCheckpointer, LocalCheckpointConfig,
                                      LocalCheckpointManager)

    config = LocalCheckpointConfig(replication_factor=1, ranks_per_node=2, keep_last=2)
    return (LocalCheckpointManager(node_root(args, rank), config),
            AsyncCheckpointer(os.path.join(args["base"], "global")))


def scenario_replicated_save(args: dict, rank: int, world: int) -> dict:
    local, persistent = _managers(args, rank)
    for step in (10, 20):
        local.save(rank_state(rank, step), step)
        local.finalize()
    persistent.save(rank_state(rank, 20), 20)
    local.close()
    persistent.close()
    return {"own_steps": local.store.steps(),
            "held": {src: local._replica_store(src).steps() for src in local.sources}}


def scenario_restore(args: dict, rank: int, world: int) -> dict:
    local, persistent = _managers(args, rank)
    latest = local.find_latest()
    from_replicas = local.load(fallback=persistent.load_latest)
    restored_steps = local.store.steps()
    local.close()
    dist.barrier()
    if rank == 0:   # now every node loses its local storage
        shutil.rmtree(os.path.join(args["base"], "local"))
    dist.barrier()
    local, unused = _managers(args, rank)
    from_global = local.load(fallback=persistent.load_latest)
    for manager in (local, unused, persistent):
        manager.close()
    return {"latest": latest, "step": from_replicas.step, "source": from_replicas.source,
            "ok": same_state(from_replicas.state, rank_state(rank, 20)),
            "restored_steps": restored_steps, "global_step": from_global.step,
            "global_source": from_global.source,
            "global_ok": same_state(from_global.state, rank_state(rank, 20))}


def scenario_restore_past_a_corrupt_replica(args: dict, rank: int, world: int) -> dict:
    local, persistent = _managers(args, rank)
    loaded = local.load()
    local.close()
    persistent.close()
    return {"step": loaded.step, "source": loaded.source,
            "ok": same_state(loaded.state, rank_state(rank, loaded.step))}


def scenario_backend_lets_go_late(args: dict, rank: int, world: int) -> dict:
    """torch.distributed keeps a reference to the tensors of an operation for a while
    after the caller's wait() returned (gloo's worker thread does, until it next runs).
    Here it is made to keep one for hold_s seconds: every checkpoint collective must
    return only after that, and then nothing may hold its tensors any more, so their
    Python objects are freed on the caller's thread, never on the backend's."""
    from torch.distributed import distributed_c10d

    from nvrx_core import collectives
    from nvrx_core.checkpoint import replication

    hold_s = 0.5
    # The fallback (a tensor still held after RELEASE_TIMEOUT_S is kept until exit) is for a
    # backend thread descheduled that long; on a loaded host the simulated backend's timer
    # thread can be, and this scenario tests the waiting, not the fallback.
    collectives.RELEASE_TIMEOUT_S = 120.0
    handed = []     # (weakref to a tensor given to the backend, the backend's reference: emptied as it lets go)

    def holding(name: str, module) -> None:
        op = getattr(module, name)

        def call(*a, **kw):
            result = op(*a, **kw)
            for arg in a[:2]:                     # the tensor, or output list and input
                for tensor in arg if isinstance(arg, (list, tuple)) else [arg]:
                    if isinstance(tensor, torch.Tensor):
                        hold(tensor)
            return result
        setattr(module, name, call)

    def hold(tensor: torch.Tensor) -> None:
        held = [tensor.view(-1)]    # a view references its base
        handed.append((weakref.ref(tensor), held))
        # One step: the list is empty exactly when its reference is gone. (A separate
        # "released" flag set after the clear raced a helper that returned in between.)
        threading.Timer(hold_s, held.clear).start()

    for name in ("all_reduce", "all_gather", "broadcast", "gather"):   # as the helper calls them
        holding(name, distributed_c10d)
    holding("isend", dist)                        # replication's point-to-point transfers
    holding("irecv", dist)
    kept = torch.arange(10, dtype=torch.uint8)    # the caller's own shard bytes

    def outcome(run) -> dict:
        start, began = len(handed), time.monotonic()
        run()
        seconds, mine = time.monotonic() - began, handed[start:]
        alive = [t for t in (r() for r, _ in mine) if t is not None and t is not kept]
        return {"handed": len(mine),
                "returned_after_backend_let_go": all(not held for _, held in mine),
                "not_held_after_return": not alive,
                # for a failure's message: what is still alive, and how long the call took
                # (collectives.wait_released keeps a tensor still held after its timeout)
                "alive": [f"{tuple(t.shape)} {t.dtype} use_count {t._use_count()}" for t in alive],
                "seconds": round(seconds, 3)}

    shipment = replication.Shipment({"checksum_algo": "crc32", "files": []}, kept)
    return {
        "all_reduce_max": outcome(lambda: collectives.all_reduce_max([rank, -rank], dist.group.WORLD)),
        "all_gather_json": outcome(lambda: collectives.all_gather_json({"r": rank}, dist.group.WORLD)),
        "transfer": outcome(lambda: replication.transfer(dist.group.WORLD, 7, {1 - rank: shipment},
                                                         [1 - rank])),
    }


def scenario_exit_without_close(args: dict, rank: int, world: int) -> None:
    """A save in flight when the process exits: no close(), no destroy_process_group().

    The save's commit step waits until the exit hook closes the checkpointer, so the save is
    still in flight when the hook looks (before: a fast worker could commit it before the
    main thread reached its exit, and the hook rightly had nothing to finish)."""
    from nvrx_core.checkpoint import AsyncCheckpointer
    from nvrx_core.checkpoint.pipelined import PipelinedSaves

    closing = threading.Event()
    close, settle = PipelinedSaves.close, AsyncCheckpointer._settle

    def close_and_say_so(saves):
        closing.set()
        return close(saves)

    def settle_once_closing(ckpt, pending, entries, error):
        assert closing.wait(120), "the exit hook never closed the checkpointer"
        return settle(ckpt, pending, entries, error)

    PipelinedSaves.close = close_and_say_so
    AsyncCheckpointer._settle = settle_once_closing    # before the checkpointer binds it
    ckpt = AsyncCheckpointer(os.path.join(args["base"], "global"))
    ckpt.save(rank_state(rank, 5) | {"big": torch.ones(8 << 20)}, 5)   # 32 MiB to write
    write_result(args, "exit_without_close", rank, {"saved": 5})
    sys.exit(0)


def write_result(args: dict, scenario: str, rank: int, result) -> None:
    with open(os.path.join(args["out"], f"{scenario}.rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["NVRX_TEST_STORE_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    result = globals()[f"scenario_{scenario}"](args, rank, world)
    write_result(args, scenario, rank, result)
    dist.barrier()
    dist.destroy_process_group()


# ---- tests -------------------------------------------------------------------------------

@pytest.mark.timeout(200)
def test_global_commit_merges_every_rank_and_corruption_on_one_rank_is_skipped_by_all(tmp_path):
    args = {"base": str(tmp_path), "out": str(tmp_path / "out")}
    results = launch("global", 2, args)
    manifest = results[0]["manifest"]
    assert manifest["world_size"] == 2 and manifest["step"] == 2
    assert sorted(manifest["ranks"]) == ["0", "1"]
    assert all(name in manifest["files"] for names in manifest["ranks"].values() for name in names)
    # rank 1's step-2 shard was damaged: both ranks agree on step 1, each with its own state
    assert [r["loaded_step"] for r in results] == [1, 1]
    assert all(r["loaded_ok"] for r in results)
    # rank 1's background write of step 3 failed: every rank raised, nothing was published
    assert "step 3" in results[0]["save_error"] and "another rank" in results[0]["save_error"]
    assert "step 3" in results[1]["save_error"] and "rank_00001.data0" in results[1]["save_error"]
    assert results[1]["dirs_after_failure"] == ["step_0000000001", "step_0000000002"]


@pytest.mark.timeout(200)
def test_an_overlapped_save_modified_early_on_one_rank_is_dropped_on_every_rank(tmp_path):
    args = {"base": str(tmp_path), "out": str(tmp_path / "out")}
    results = launch("overlapped_modified_on_one_rank", 2, args)
    assert list(results[1]["errors"]) == ["2"]
    assert results[1]["errors"]["2"].startswith("SnapshotModifiedError: checkpoint save of step 2")
    assert list(results[0]["errors"]) == ["2"]
    assert results[0]["errors"]["2"].startswith("CheckpointSaveError: ")
    assert "step 2" in results[0]["errors"]["2"] and "another rank" in results[0]["errors"]["2"]
    for result in results:                    # step 2 never committed; steps 1 and 3 intact
        assert result["steps"] == [1, 3] and result["leftovers"] == []
        assert result["loaded_step"] == 3 and result["loaded_ok"]


@pytest.mark.timeout(200)
def test_local_find_latest_is_the_newest_step_every_rank_has(tmp_path):
    args = {"base": str(tmp_path), "out": str(tmp_path / "out")}
    results = launch("local_find_latest", 4, args)
    assert results[2]["own_steps"] == [10, 20]
    assert all(results[r]["own_steps"] == [10, 20, 30] for r in (0, 1, 3))
    assert [r["latest"] for r in results] == [20] * 4
    assert [(r["loaded_step"], r["source"]) for r in results] == [(20, "local")] * 4
    assert all(r["loaded_ok"] for r in results)


@pytest.mark.timeout(400)
def test_lost_node_is_restored_from_replicas_then_falls_back_to_global(tmp_path):
    args = {"base": str(tmp_path), "out": str(tmp_path / "out")}
    saved = launch("replicated_save", 4, args)
    # ranks 0,1 live on node0, ranks 2,3 on node1; each shard has a copy on the other node
    assert [r["held"] for r in saved] == [{"2": [10, 20]}, {"3": [10, 20]},
                                          {"0": [10, 20]}, {"1": [10, 20]}]
    shutil.rmtree(tmp_path / "local" / "node1")
    damaged = tmp_path / "damaged"          # the same loss, and rank 3's newest replica is bad
    shutil.copytree(tmp_path, damaged, ignore=shutil.ignore_patterns("damaged", "out"))
    flip_byte(damaged / "local" / "node0" / "replicas" / "rank_00003" / "step_0000000020"
              / "rank_00003.data0")

    results = launch("restore", 4, args)
    assert [r["latest"] for r in results] == [20] * 4
    assert [r["source"] for r in results] == ["local", "local", "replica", "replica"]
    assert all(r["ok"] and r["step"] == 20 for r in results)
    assert [r["restored_steps"] for r in results][2:] == [[20], [20]]   # node1 rebuilt
    assert [(r["global_step"], r["global_source"]) for r in results] == [(20, "global")] * 4
    assert all(r["global_ok"] for r in results)

    # the corrupt replica fails its checksum on arrival: all ranks fall back to step 10
    results = launch("restore_past_a_corrupt_replica", 4,
                     {"base": str(damaged), "out": str(tmp_path / "out")})
    assert [(r["step"], r["source"]) for r in results] == [
        (10, "local"), (10, "local"), (10, "replica"), (10, "replica")]
    assert all(r["ok"] for r in results)


@pytest.mark.timeout(200)
def test_checkpoint_collectives_return_only_after_the_backend_let_go_of_their_tensors(tmp_path):
    """The exit abort of the overlapped test: gloo's worker thread dropped the last
    reference to a collective's tensor after the interpreter had begun to exit."""
    args = {"base": str(tmp_path), "out": str(tmp_path / "out")}
    results = launch("backend_lets_go_late", 2, args)
    logs = "".join(open(os.path.join(args["out"], f"backend_lets_go_late.rank{r}.log")).read()[-2000:]
                   for r in range(2))
    for result in results:
        assert result["transfer"]["handed"] == 6             # 2 headers, table + bytes each way
        for name, outcome in result.items():
            assert outcome["handed"] >= 1, name
            assert outcome["returned_after_backend_let_go"], (name, outcome, logs)
            assert outcome["not_held_after_return"], (name, outcome, logs)


@pytest.mark.timeout(200)
def test_a_save_in_flight_when_the_job_exits_without_close_is_finished(tmp_path):
    args = {"base": str(tmp_path), "out": str(tmp_path / "out")}
    launch("exit_without_close", 2, args)           # fails on any non-zero exit code
    from nvrx_core.checkpoint import read_manifest, verify_checkpoint

    path = str(tmp_path / "global" / "step_0000000005")
    verify_checkpoint(path)
    assert sorted(read_manifest(path).ranks) == [0, 1]
    for rank in (0, 1):
        log = (tmp_path / "out" / f"exit_without_close.rank{rank}.log").read_text()
        assert "not closed before the interpreter exits: finishing the saves of steps [5]" in log


def flip_byte(path, offset=100):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


if __name__ == "__main__":
    main()
