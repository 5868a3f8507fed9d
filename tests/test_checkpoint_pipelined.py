"""PipelinedSaves: the save lifecycle the three checkpointers share, judged through each of them.

Real files, the real background worker, the real exit of a real process. A save that must
still be in flight when abort() comes waits, inside its settle step, for abort()'s own
cancellation: the test cannot pass by the save having finished early, nor wait on a clock.
"""

import errno
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

import warm_python
from nvrx_core.checkpoint import (CHECKPOINT_ABORTED, CHECKPOINT_FAILED, AsyncCheckpointer,
                                  CheckpointConfig, CheckpointSaveError, LocalCheckpointManager)
from nvrx_core.checkpoint import path_checkpointer
from nvrx_core.checkpoint.path_checkpointer import PathCheckpointer
from nvrx_core.events import EventLog, read_events

HERE = os.path.abspath(__file__)


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


def events_of(events_file: str, kind: str) -> list:
    return [e for e in read_events(events_file) if e["kind"] == kind]


def hidden(directory) -> list:
    """Partial directories, writer locks: what a finished or aborted save must not leave.
    (A save aborted before its write began never created its directory, nor its parents.)"""
    return sorted(n for n in os.listdir(directory) if n.startswith(".")) if os.path.isdir(directory) else []


def test_every_failed_save_is_reported_before_the_first_is_raised(tmp_path, monkeypatch):
    """Two saves fail together: both get their event, the older one's error is raised.

    Each save's commit step waits until both saves are started: a save that failed before
    the next save() would be raised by that save() (as it must), not by finalize().
    """
    both_started = threading.Event()
    settle = AsyncCheckpointer._settle

    def settle_once_both_started(self, pending, entries, error):
        assert both_started.wait(120), "the test never started the second save"
        return settle(self, pending, entries, error)

    def disk_full_once_both_started(*args, **kwargs):
        assert both_started.wait(120), "the test never started the second save"
        disk_full()

    monkeypatch.setattr(AsyncCheckpointer, "_settle", settle_once_both_started)
    events_file = str(tmp_path / "events.jsonl")
    config = CheckpointConfig(max_pending_saves=2)
    root = tmp_path / "steps"
    steps = AsyncCheckpointer(str(root), config, process_group=None, events=EventLog(events_file))
    root.rmdir()
    root.write_text("not a directory")          # neither save can create its directory
    steps.save({"w": torch.ones(4)}, 1)
    steps.save({"w": torch.ones(4)}, 2)
    both_started.set()
    with pytest.raises(CheckpointSaveError, match="checkpoint save of step 1 failed"):
        steps.finalize(blocking=True)
    assert steps.pending_steps == []
    steps.close()
    assert [(e["step"], e["generation"]) for e in events_of(events_file, CHECKPOINT_FAILED)] == [(1, 1), (2, 2)]

    both_started.clear()
    monkeypatch.setattr(path_checkpointer, "publish", disk_full_once_both_started)
    paths = PathCheckpointer(config, events=EventLog(events_file))
    paths.save({"w": torch.ones(4)}, tmp_path / "a.ckpt")
    paths.save({"w": torch.ones(4)}, tmp_path / "b.ckpt")
    both_started.set()
    with pytest.raises(CheckpointSaveError, match=r"a\.ckpt failed.*No space left"):
        paths.finalize(blocking=True)
    assert paths.pending_paths == []
    paths.close()
    assert [e.get("path") for e in events_of(events_file, CHECKPOINT_FAILED)][2:] == [
        str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")]


def settle_only_once_aborted(monkeypatch, cls, step: int) -> None:
    """The save of `step` reaches its settle step and waits there for abort()'s cancellation."""
    real = cls._settle

    def settle(self, pending, entries, error):
        if pending.step == step:
            assert pending.cancel.wait(120), "abort() never cancelled the save"
        return real(self, pending, entries, error)

    monkeypatch.setattr(cls, "_settle", settle)


@pytest.mark.parametrize("kind", ["async", "local"])
def test_abort_stops_the_save_deletes_its_output_and_says_so(tmp_path, monkeypatch, kind):
    events_file = str(tmp_path / "events.jsonl")
    if kind == "async":
        settle_only_once_aborted(monkeypatch, AsyncCheckpointer, 5)
        ckpt = AsyncCheckpointer(str(tmp_path / "ckpt"), process_group=None, events=EventLog(events_file))
        directory = tmp_path / "ckpt"
    else:
        settle_only_once_aborted(monkeypatch, LocalCheckpointManager, 5)
        ckpt = LocalCheckpointManager(str(tmp_path / "local"), process_group=None,
                                      events=EventLog(events_file))
        directory = tmp_path / "local" / "rank_00000"
    ckpt.save({"w": torch.ones(4)}, 5)
    assert ckpt.abort() == [5]
    assert hidden(directory) == [] and ckpt.finalize(blocking=True) == []
    aborted = events_of(events_file, CHECKPOINT_ABORTED)
    assert [(e["step"], e["generation"], e.get("tier")) for e in aborted] == [
        (5, 1, "local" if kind == "local" else None)]
    ckpt.save({"w": torch.ones(4)}, 6)                # the checkpointer keeps working
    assert ckpt.finalize(blocking=True) == [6]
    ckpt.close()
    ckpt.close()                                       # a second close does nothing


def test_a_checkpointer_never_closed_is_closed_at_exit_and_its_failure_reported(tmp_path):
    """The exit hook runs the checkpointer's own close: the failed save gets its event and a
    log line, and the writer lock is released (before: the pipeline alone was closed)."""
    log = tmp_path / "child.log"
    with open(log, "w") as out:
        child = warm_python.popen([HERE, "exit_without_close", str(tmp_path)], stdout=out,
                                  stderr=warm_python.STDOUT)
        try:
            assert child.wait(timeout=120) == 0, log.read_text()
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
    text = log.read_text()
    target = os.path.join(os.path.realpath(tmp_path / "ckpt"), "last.ckpt")
    assert f"closing the checkpointer at interpreter exit: checkpoint save to {target} failed" in text
    failed = events_of(str(tmp_path / "events.jsonl"), CHECKPOINT_FAILED)
    assert [(e["step"], e["path"]) for e in failed] == [(7, target)]
    assert hidden(tmp_path / "ckpt") == []             # no partial directory, no writer lock


def exit_without_close(directory: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    path_checkpointer.publish = disk_full
    ckpt = PathCheckpointer(events=EventLog(os.path.join(directory, "events.jsonl")))
    ckpt.save({"w": torch.ones(4)}, os.path.join(directory, "ckpt", "last.ckpt"), step=7)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
