"""PathCheckpointer and path_publish: saves to caller-named paths, published atomically.

Real files and the real background worker. Where a test needs a save to be still in flight
when the next call comes, the publish step waits on a gate that the test opens only once
that call has started waiting for the save (so the test cannot pass by the save having
finished early)."""

import collections
import errno
import os

import pytest
import torch

from nvrx_core.checkpoint import (CHECKPOINT_FAILED, CheckpointConfig, CheckpointCorruptError,
                                  CheckpointError, CheckpointNotFoundError, CheckpointSaveError,
                                  read_manifest)
from nvrx_core.checkpoint import path_checkpointer, path_publish
from nvrx_core.checkpoint.path_checkpointer import PathCheckpointer, is_path_checkpoint, load_path
from nvrx_core.checkpoint.path_publish import hidden_name
from nvrx_core.events import CHECKPOINT_COMMITTED, EventLog, read_events
from harness.checkpoint_gate import PublishGate


def state(value: float) -> dict:
    return {
        "state_dict": collections.OrderedDict(
            [("w", torch.full((64, 64), value)), ("b", torch.arange(8, dtype=torch.bfloat16))]),
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}],
        "global_step": int(value), "name": "x", "nothing": None, "pair": (1, 2.5),
        "score": torch.tensor(value),
    }


def assert_state(loaded: dict, value: float) -> None:
    expected = state(value)
    assert type(loaded["state_dict"]) is collections.OrderedDict
    assert list(loaded["state_dict"]) == ["w", "b"]
    for key, tensor in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], tensor) and loaded["state_dict"][key].dtype == tensor.dtype
    assert torch.equal(loaded["score"], expected["score"])
    for key in ("optimizer_states", "global_step", "name", "nothing", "pair"):
        assert loaded[key] == expected[key], key


def hidden_entries(directory) -> list:
    return sorted(n for n in os.listdir(directory) if ".nvrx-" in n)


def test_round_trip_and_on_disk_format(tmp_path):
    events_file = str(tmp_path / "events.jsonl")
    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    with PathCheckpointer(events=EventLog(events_file)) as ckpt:
        generation = ckpt.save(state(3), path, step=3)
        assert ckpt.pending_paths == [str(path)]
    assert is_path_checkpoint(path) and ckpt.pending_paths == []
    manifest = read_manifest(str(path))
    assert (manifest.step, manifest.world_size, manifest.generation) == (3, 1, generation)
    assert_state(load_path(path), 3)
    assert_state(load_path(str(path), map_location="cpu", weights_only=None), 3)
    assert hidden_entries(path.parent) == []
    committed = [e for e in read_events(events_file) if e["kind"] == CHECKPOINT_COMMITTED]
    assert [(e["path"], e["step"], e["replaced"]) for e in committed] == [(str(path), 3, False)]


def test_save_returns_a_snapshot_the_caller_may_modify(tmp_path):
    path = tmp_path / "last.ckpt"
    live = state(1)
    with PathCheckpointer() as ckpt:
        ckpt.save(live, path)
        live["state_dict"]["w"].add_(100)     # the optimizer step right after the save
        live["optimizer_states"][0]["param_groups"][0]["lr"] = 9.0
    assert_state(load_path(path), 1)


@pytest.mark.parametrize("exchange_supported", [True, False])
def test_saving_over_a_path_replaces_it_atomically(tmp_path, monkeypatch, exchange_supported):
    calls = []
    real = path_publish.exchange

    def spy(first, second):
        calls.append(second)
        return real(first, second) if exchange_supported else False

    monkeypatch.setattr(path_publish, "exchange", spy)
    path = tmp_path / "last.ckpt"
    with PathCheckpointer() as ckpt:
        for value in (1, 2, 3):
            ckpt.save(state(value), path, step=value)
            ckpt.wait_for(path)
            assert_state(load_path(path), value)
    assert calls == [str(path)] * 2
    assert hidden_entries(tmp_path) == []


def test_real_exchange_swaps_directories(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    (first / "f").write_text("a"), (second / "f").write_text("b")
    if not path_publish.exchange(str(first), str(second)):
        pytest.skip("renameat2(RENAME_EXCHANGE) not supported here")
    assert (first / "f").read_text() == "b" and (second / "f").read_text() == "a"


def test_a_plain_file_or_a_symlink_at_the_path_is_replaced(tmp_path):
    plain, link, pointed = tmp_path / "old.ckpt", tmp_path / "last.ckpt", tmp_path / "keep.ckpt"
    torch.save({"old": 1}, plain)
    with PathCheckpointer() as ckpt:
        ckpt.save(state(5), pointed)
    os.symlink("keep.ckpt", link)
    with PathCheckpointer() as ckpt:
        ckpt.save(state(6), plain)
        ckpt.save(state(7), link)
    assert_state(load_path(plain), 6)
    assert not os.path.islink(link)
    assert_state(load_path(link), 7)
    assert_state(load_path(pointed), 5)          # the link's old target is untouched


def test_load_finishes_the_write_in_flight_to_that_path(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    ckpt = PathCheckpointer()
    ckpt.save(state(1), path)
    ckpt.wait_for(path)
    gate = PublishGate(monkeypatch)
    ckpt.save(state(2), path)
    assert gate.reached.wait(60)
    assert_state(load_path(path), 1)             # not yet published
    gate.open_when_waited_on()
    assert_state(ckpt.load(path), 2)
    assert gate.waited.is_set()
    ckpt.close()


def test_load_through_a_symlink_finishes_the_write_of_its_target(tmp_path, monkeypatch):
    target, link = tmp_path / "epoch=0-step=4.ckpt", tmp_path / "last.ckpt"
    ckpt = PathCheckpointer()
    gate = PublishGate(monkeypatch)
    ckpt.save(state(4), target)
    os.symlink(target.name, link)                # ModelCheckpoint(save_last="link")
    assert gate.reached.wait(60)
    gate.open_when_waited_on()
    assert_state(ckpt.load(link), 4)
    ckpt.close()


def test_remove_finishes_the_write_in_flight_so_it_cannot_reappear(tmp_path, monkeypatch):
    path, other = tmp_path / "epoch=0-step=2.ckpt", tmp_path / "epoch=0-step=4.ckpt"
    ckpt = PathCheckpointer(CheckpointConfig(max_pending_saves=2))
    gate = PublishGate(monkeypatch)
    ckpt.save(state(2), path)
    assert gate.reached.wait(60)
    gate.open_when_waited_on()
    assert ckpt.remove(path) is True
    assert gate.waited.is_set() and not os.path.lexists(path)
    ckpt.save(state(4), other)
    ckpt.close()
    assert not os.path.lexists(path) and is_path_checkpoint(other)
    assert hidden_entries(tmp_path) == []
    assert ckpt.remove(path) is False


def test_background_failure_is_raised_at_the_next_save_and_keeps_the_previous(tmp_path, monkeypatch):
    events_file = str(tmp_path / "events.jsonl")
    path = tmp_path / "last.ckpt"
    ckpt = PathCheckpointer(events=EventLog(events_file))
    ckpt.save(state(1), path)
    ckpt.wait_for(path)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(path_checkpointer, "publish", disk_full)
    ckpt.save(state(2), path)
    with pytest.raises(CheckpointSaveError, match="No space left") as raised:
        ckpt.save(state(3), path)               # max_pending_saves=1: waits for the failed one
    assert str(path) in str(raised.value) and isinstance(raised.value.__cause__, OSError)
    ckpt.close()                                # the failure was reported once
    assert_state(load_path(path), 1)
    assert hidden_entries(tmp_path) == []
    failed = [e for e in read_events(events_file) if e["kind"] == CHECKPOINT_FAILED]
    assert [e["path"] for e in failed] == [str(path)]


def test_background_failure_is_raised_at_close(tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(path_checkpointer, "publish", disk_full)
    ckpt = PathCheckpointer()
    ckpt.save(state(1), tmp_path / "a.ckpt")
    with pytest.raises(CheckpointSaveError, match="a.ckpt"):
        ckpt.close()
    quiet = PathCheckpointer(CheckpointConfig(fail_on_save_error=False))
    quiet.save(state(1), tmp_path / "b.ckpt")
    quiet.close()                                # logged, not raised
    assert not os.path.lexists(tmp_path / "a.ckpt") and not os.path.lexists(tmp_path / "b.ckpt")


def test_leftovers_of_a_crashed_run_are_cleaned_and_an_aside_copy_restored(tmp_path):
    path, swapped = tmp_path / "last.ckpt", tmp_path / "epoch=1.ckpt"
    with PathCheckpointer() as ckpt:
        ckpt.save(state(1), path)
        ckpt.save(state(2), swapped)
    crashed_run = 0x1234
    partial = hidden_name(str(path), "partial", crashed_run, 7)
    os.makedirs(partial)
    open(os.path.join(partial, "rank_00000.data0"), "wb").close()
    os.rename(swapped, hidden_name(str(swapped), "aside", crashed_run, 3))  # crash mid-swap
    os.makedirs(hidden_name(str(path), "trash", crashed_run, 0))
    with PathCheckpointer() as ckpt:
        ckpt.save(state(3), tmp_path / "epoch=2.ckpt")
    assert hidden_entries(tmp_path) == []
    assert_state(load_path(swapped), 2)
    assert_state(load_path(path), 1)


def test_bad_arguments_are_named(tmp_path):
    with PathCheckpointer() as ckpt:
        with pytest.raises(TypeError, match="path=123"):
            ckpt.save(state(1), 123)
        with pytest.raises(ValueError, match="path='s3://bucket/x.ckpt'"):
            ckpt.save(state(1), "s3://bucket/x.ckpt")
        with pytest.raises(CheckpointError, match="step=-1"):
            ckpt.save(state(1), tmp_path / "x.ckpt", step=-1)
    with pytest.raises(TypeError, match="config="):
        PathCheckpointer({"writer_threads": 1})
    with pytest.raises(CheckpointNotFoundError):
        load_path(tmp_path / "missing.ckpt")
    (tmp_path / "empty.ckpt").mkdir()
    with pytest.raises(CheckpointCorruptError, match="manifest"):
        load_path(tmp_path / "empty.ckpt")
    with PathCheckpointer() as ckpt:
        ckpt.save(state(1), tmp_path / "ok.ckpt")
    with pytest.raises(TypeError, match="map_location"):
        load_path(tmp_path / "ok.ckpt", map_location=lambda storage, loc: storage)


def test_the_sweep_spares_a_live_writer_in_the_same_directory(tmp_path, monkeypatch):
    gate = PublishGate(monkeypatch)
    first, second = PathCheckpointer(), PathCheckpointer()
    first.save(state(1), tmp_path / "a.ckpt")
    assert gate.reached.wait(60)                 # first's partial directory is on disk
    second.save(state(2), tmp_path / "b.ckpt")   # its sweep must leave first's files alone
    gate.released.set()
    first.close(), second.close()
    assert_state(load_path(tmp_path / "a.ckpt"), 1)
    assert_state(load_path(tmp_path / "b.ckpt"), 2)
    assert hidden_entries(tmp_path) == []


def test_the_sweep_spares_a_writer_alive_in_another_process(tmp_path):
    """A process holding its writer lock keeps its partial directory; once it has exited
    (killed: the kernel drops the lock) the next sweep removes both."""
    import subprocess
    import sys

    run = 0xABCDEF
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from nvrx_core.checkpoint.path_publish import "
         f"hold_writer_lock; assert hold_writer_lock({str(tmp_path)!r}, {run}) is not None; "
         "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        partial = hidden_name(str(tmp_path / "last.ckpt"), "partial", run, 1)
        os.makedirs(partial)
        with PathCheckpointer() as ckpt:
            ckpt.save(state(1), tmp_path / "x.ckpt")
        assert os.path.isdir(partial)
    finally:
        holder.kill()
        holder.wait()
    with PathCheckpointer() as ckpt:
        ckpt.save(state(2), tmp_path / "y.ckpt")
    assert hidden_entries(tmp_path) == []
