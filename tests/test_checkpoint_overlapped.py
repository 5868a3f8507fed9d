"""Overlapped staging: save() returns before the copy to host memory, the loop calls
wait_staged() before it modifies the saved tensors. A loop that follows that contract gets
the same checkpoint as a blocking save; one that modifies a tensor too early gets a clear
error, and that save is never committed. Real training steps, real files, real threads."""

import concurrent.futures
import copy
import os
import time

import pytest
import torch

from nvrx_core.checkpoint import (CHECKPOINT_FAILED, AsyncCheckpointer, CheckpointConfig,
                                  CheckpointSaveError, SnapshotModifiedError, read_manifest)
from nvrx_core.checkpoint.staging import HostStager
from nvrx_core.events import CHECKPOINT_COMMITTED, EventLog, read_events

OVERLAPPED = CheckpointConfig(staging="overlapped")


def committed_dirs(root):
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


def leftovers(root):
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def assert_bit_identical(expected, actual, path="root"):
    assert type(expected) is type(actual), path
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, path
        assert expected.reshape(-1).view(torch.uint8).equal(actual.reshape(-1).view(torch.uint8)), path
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), path
        for key in expected:
            assert_bit_identical(expected[key], actual[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), path
        for i, (a, b) in enumerate(zip(expected, actual)):
            assert_bit_identical(a, b, f"{path}[{i}]")
    else:
        assert expected == actual, path


class Trainer:
    """A real model and optimizer (AdamW, foreach): 16 MiB of weights, 48 MiB of state, so
    the overlapped copy is still running while forward/backward compute."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        self.batch = torch.randn(16, 1024)

    def state(self):
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict(), "note": "x"}

    def forward_backward(self):
        self.optim.zero_grad()
        self.model(self.batch).pow(2).mean().backward()


def test_following_the_contract_gives_a_checkpoint_bit_identical_to_a_blocking_save(tmp_path):
    trainer = Trainer()
    blocking = AsyncCheckpointer(str(tmp_path / "blocking"), process_group=None)
    overlapped = AsyncCheckpointer(str(tmp_path / "overlapped"), OVERLAPPED, process_group=None)
    snapshots = {}
    for step in range(5):
        if step in (2, 3):
            state = trainer.state()
            blocking.save(state, step)
            snapshots[step] = copy.deepcopy(state)
            overlapped.save(state, step)         # returns before the copy is done
        trainer.forward_backward()               # reads the weights while they are copied
        overlapped.wait_staged()
        trainer.optim.step()                     # in place: only now
        overlapped.finalize()
        blocking.finalize()
    overlapped.close()
    blocking.close()
    for step in (2, 3):
        from_blocking = blocking.load(step)
        from_overlapped = overlapped.load(step)
        assert_bit_identical(snapshots[step], from_overlapped)
        assert_bit_identical(from_blocking, from_overlapped)
        manifests = [read_manifest(c.store.path(step)) for c in (blocking, overlapped)]
        data = [{n: (e.size, e.checksum) for n, e in m.files.items() if ".data" in n}
                for m in manifests]
        assert data[0] == data[1] and data[0]    # the same bytes on disk
    # the weights moved on after the saves: the snapshots really are of steps 2 and 3
    assert not torch.equal(trainer.model[0].weight, snapshots[3]["model"]["0.weight"])
    assert overlapped.store.steps() == [2, 3]


@pytest.mark.parametrize("reported_by", ["wait_staged", "finalize", "next_save"])
def test_modifying_before_wait_staged_drops_the_save_with_a_clear_error(tmp_path, monkeypatch,
                                                                       reported_by):
    """finalize() confirms only the copies that have finished (it never waits for one): the
    test waits for save 2's copy before calling it. wait_staged() and the next save wait."""
    jobs = []
    stage_async = HostStager.stage_async

    def recording(self, state):
        jobs.append(stage_async(self, state))
        return jobs[-1]

    monkeypatch.setattr(HostStager, "stage_async", recording)
    events_file = str(tmp_path / "events.jsonl")
    root = tmp_path / "ckpt"
    # fail_on_save_error=False does not hide it: it is a bug in the loop, not a disk fault
    config = CheckpointConfig(staging="overlapped", fail_on_save_error=False)
    ckpt = AsyncCheckpointer(str(root), config, process_group=None, events=EventLog(events_file))
    trainer = Trainer()
    good = copy.deepcopy(trainer.state())
    ckpt.save(trainer.state(), 1)
    ckpt.wait_staged()
    assert ckpt.finalize(blocking=True) == [1]

    ckpt.save(trainer.state(), 2)
    trainer.forward_backward()
    trainer.optim.step()                         # the bug: no wait_staged() first
    with pytest.raises(SnapshotModifiedError, match=r"step 2 dropped: \d+ saved tensor\(s\) "
                       r"were modified in place .*model\.0\.weight.*call wait_staged\(\)") as caught:
        if reported_by == "wait_staged":
            ckpt.wait_staged()
        elif reported_by == "finalize":
            done, _ = concurrent.futures.wait([jobs[-1].copied], timeout=120)
            assert done, "the copy of save 2 never finished"
            ckpt.finalize()
        else:
            ckpt.save(trainer.state(), 3)
    assert isinstance(caught.value, CheckpointSaveError)   # existing save-error handlers see it
    assert ckpt.finalize(blocking=True) == []    # reported once, never committed
    assert ckpt.pending_steps == []
    assert committed_dirs(root) == ["step_0000000001"] and leftovers(root) == []
    step, loaded = ckpt.load_latest()
    assert step == 1
    assert_bit_identical(good, loaded)
    kinds = [(e["kind"], e["step"]) for e in read_events(events_file)
             if e["kind"] in (CHECKPOINT_FAILED, CHECKPOINT_COMMITTED)]
    assert kinds == [(CHECKPOINT_COMMITTED, 1), (CHECKPOINT_FAILED, 2)]

    ckpt.save(trainer.state(), 4)                # the checkpointer goes on working
    expected = copy.deepcopy(trainer.state())
    ckpt.wait_staged()
    trainer.optim.step()
    assert ckpt.finalize(blocking=True) == [4]
    assert_bit_identical(expected, ckpt.load(4))
    ckpt.close()


def test_in_blocking_mode_the_same_early_update_is_harmless(tmp_path):
    trainer = Trainer()
    with AsyncCheckpointer(str(tmp_path), process_group=None) as ckpt:
        ckpt.save(trainer.state(), 1)
        expected = copy.deepcopy(trainer.state())
        trainer.forward_backward()
        trainer.optim.step()
        ckpt.wait_staged()                       # nothing to wait for: save() copied
        assert ckpt.finalize(blocking=True) == [1]
        assert_bit_identical(expected, ckpt.load(1))


def test_a_written_save_is_not_committed_before_its_copy_is_confirmed(tmp_path):
    weights = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(16)}   # 64 MiB
    ckpt = AsyncCheckpointer(str(tmp_path), OVERLAPPED, process_group=None)
    ckpt.save(weights, 1)
    # Wait until the background write is complete (data file full, index written)...
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        partial = [os.path.join(tmp_path, d) for d in leftovers(tmp_path)]
        files = os.listdir(partial[0]) if partial else []
        sizes = sum(os.path.getsize(os.path.join(partial[0], f)) for f in files if ".data" in f)
        if "rank_00000.index" in files and sizes == 64 << 20:
            break
        time.sleep(0.01)
    else:
        pytest.fail("the background write did not finish")
    # ...then watch: without a confirmation from the training thread nothing is committed.
    watch_until = time.monotonic() + 1.0
    while time.monotonic() < watch_until:
        assert committed_dirs(tmp_path) == []
        time.sleep(0.02)
    ckpt.wait_staged()
    assert ckpt.finalize(blocking=True) == [1]
    assert ckpt.load(1)["w7"][0].item() == 7.0
    ckpt.close()


def test_close_confirms_and_commits_a_save_never_waited_for(tmp_path):
    state = {"w": torch.arange(1 << 18, dtype=torch.float32), "strided": torch.ones(8, 4).t(),
             "conj": torch.tensor([1 + 2j]).conj(), "meta": {"lr": 0.1}}
    with AsyncCheckpointer(str(tmp_path), OVERLAPPED, process_group=None) as ckpt:
        ckpt.save(state, 5)
    loaded = AsyncCheckpointer(str(tmp_path), process_group=None).load(5)
    assert_bit_identical({**state, "strided": state["strided"].contiguous(),
                          "conj": state["conj"].resolve_conj()}, loaded)


def test_abort_stops_an_overlapped_save_and_the_next_one_works(tmp_path):
    config = CheckpointConfig(staging="overlapped", chunk_bytes=1 << 16, writer_threads=1)
    with AsyncCheckpointer(str(tmp_path), config, process_group=None) as ckpt:
        ckpt.save({f"t{i}": torch.ones(1 << 18) for i in range(64)}, 1)
        assert ckpt.abort() == [1]
        assert leftovers(tmp_path) == [] and committed_dirs(tmp_path) == []
        ckpt.wait_staged()                       # nothing left to confirm
        ckpt.save({"w": torch.full((10,), 2.0)}, 2)
        ckpt.wait_staged()
        assert ckpt.finalize(blocking=True) == [2]


def test_inference_mode_tensors_are_copied_before_save_returns(tmp_path):
    with torch.inference_mode():
        weights = torch.ones(1 << 16)            # no version counter: cannot be checked
    with AsyncCheckpointer(str(tmp_path), OVERLAPPED, process_group=None) as ckpt:
        ckpt.save({"w": weights}, 1)
        with torch.inference_mode():
            weights.add_(1)                      # after save(): must not reach the checkpoint
        ckpt.wait_staged()
        assert ckpt.finalize(blocking=True) == [1]
        assert torch.equal(ckpt.load(1)["w"], torch.ones(1 << 16))
