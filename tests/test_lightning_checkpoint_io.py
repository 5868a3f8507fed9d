"""NVRxAsyncCheckpointIO with a real Lightning Trainer on the CPU: ModelCheckpoint's top-k
removal and save_last, resuming from "last", fit twice on one Trainer, background errors at
the next save and at teardown, load/remove of a path still being written, a process
SIGKILLed mid-save, and DDP (gloo) where only global rank 0 writes.

Where a save must still be in flight when the next call comes, the core's publish step
waits on a gate that the test opens only once that call is waiting for the save."""

import errno
import json
import logging
import os
import pickle
import signal
import sys

import pytest
import torch

from harness import wait_for
from harness.checkpoint_gate import PublishGate
import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
sys.path.insert(0, SCRIPTS)

from lightning_ckptio_model import TinyModel, make_trainer, momentum, weights  # noqa: E402
from nvrx_core.checkpoint import CheckpointSaveError  # noqa: E402
from nvrx_core.checkpoint import path_checkpointer  # noqa: E402
from nvrx_core.checkpoint.path_checkpointer import is_path_checkpoint, load_path  # noqa: E402
from nvrx_core.config import ConfigError  # noqa: E402
from nvrx_lightning._compat import pl  # noqa: E402
from nvrx_lightning.checkpoint_io import NVRxAsyncCheckpointIO  # noqa: E402

REPO = os.path.dirname(HERE)


def assert_equal_tensors(expected, actual):
    if isinstance(expected, dict):
        assert sorted(expected) == sorted(actual)
        expected, actual = [expected[k] for k in sorted(expected)], [actual[k] for k in sorted(actual)]
    assert len(expected) == len(actual)
    for a, b in zip(expected, actual):
        assert torch.equal(a, b)


def hidden_entries(directory) -> list:
    return sorted(n for n in os.listdir(directory) if ".nvrx-" in n)


def fail_publish(monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(path_checkpointer, "publish", disk_full)


def test_fit_keeps_top_k_and_last_and_a_new_trainer_resumes_from_last(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    io = NVRxAsyncCheckpointIO()
    first = TinyModel()
    trainer = make_trainer(dirpath, max_steps=6, io=io)
    trainer.fit(first)
    assert io._checkpointer is None                      # teardown stopped the writer
    names = sorted(os.listdir(dirpath))
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]   # step 2 removed
    assert all(is_path_checkpoint(os.path.join(dirpath, n)) for n in names)
    saved = io.load_checkpoint(os.path.join(dirpath, "last.ckpt"))
    assert saved["global_step"] == 6
    assert_equal_tensors(weights(first), saved["state_dict"])
    end_momentum = momentum(trainer.optimizers[0])

    second = TinyModel()
    make_trainer(dirpath, max_steps=8, io=NVRxAsyncCheckpointIO()).fit(second, ckpt_path="last")
    assert second.start_step == 6
    assert_equal_tensors(weights(first), second.start_weights)
    assert_equal_tensors(end_momentum, second.start_momentum)
    assert sorted(os.listdir(dirpath)) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]


def test_save_last_link_resumes_through_the_symlink(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    first = TinyModel()
    make_trainer(dirpath, max_steps=4, io=NVRxAsyncCheckpointIO(), save_last="link").fit(first)
    last = os.path.join(dirpath, "last.ckpt")
    assert os.readlink(last) == "epoch=0-step=4.ckpt"
    second = TinyModel()
    make_trainer(dirpath, max_steps=6, io=NVRxAsyncCheckpointIO(), save_last="link").fit(
        second, ckpt_path="last")
    assert second.start_step == 4
    assert_equal_tensors(weights(first), second.start_weights)
    assert os.readlink(last) == "epoch=0-step=6.ckpt"
    assert sorted(os.listdir(dirpath)) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]


def test_fit_twice_on_one_trainer(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    io = NVRxAsyncCheckpointIO()
    trainer = make_trainer(dirpath, max_steps=4, io=io)
    first = TinyModel()
    trainer.fit(first)
    end_of_first = weights(first)
    trainer.fit_loop.epoch_loop.max_steps = 8
    second = TinyModel()
    trainer.fit(second, ckpt_path="last")
    assert io._checkpointer is None
    assert second.start_step == 4
    assert_equal_tensors(end_of_first, second.start_weights)
    saved = io.load_checkpoint(os.path.join(dirpath, "last.ckpt"))
    assert saved["global_step"] == 8
    assert_equal_tensors(weights(second), saved["state_dict"])
    assert hidden_entries(dirpath) == []


def test_load_and_remove_finish_the_write_in_flight(tmp_path, monkeypatch):
    path, doomed = str(tmp_path / "last.ckpt"), str(tmp_path / "epoch=0-step=2.ckpt")
    io = NVRxAsyncCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, doomed, {"blocking": True})
    gate = PublishGate(monkeypatch)
    checkpoint = {"global_step": 2, "w": torch.full((3,), 2.0)}
    io.save_checkpoint(checkpoint, path)
    checkpoint["w"].add_(1)                              # safe: the save took a snapshot
    assert gate.reached.wait(60)
    assert load_path(path)["global_step"] == 1           # still the committed one
    gate.open_when_waited_on()
    loaded = io.load_checkpoint(path)
    assert gate.waited.is_set() and loaded["global_step"] == 2
    assert torch.equal(loaded["w"], torch.full((3,), 2.0))

    gate.reset()
    io.save_checkpoint({"global_step": 3, "w": torch.zeros(3)}, doomed)
    assert gate.reached.wait(60)
    gate.open_when_waited_on()
    io.remove_checkpoint(doomed)
    assert gate.waited.is_set() and not os.path.lexists(doomed)
    io.teardown()
    assert not os.path.lexists(doomed) and hidden_entries(tmp_path) == []


def test_background_error_is_raised_at_the_next_save(tmp_path, monkeypatch):
    fail_publish(monkeypatch)
    io = NVRxAsyncCheckpointIO(config={"max_pending_saves": 1})   # the next save waits for it
    trainer = make_trainer(str(tmp_path / "ckpt"), max_steps=6, io=io, save_top_k=-1, save_last=False)
    with pytest.raises(CheckpointSaveError, match=r"step=2\.ckpt failed.*No space left"):
        trainer.fit(TinyModel())
    assert trainer.global_step == 4                      # raised by the save of step 4
    assert io._checkpointer is None


def test_background_error_is_raised_at_teardown(tmp_path, monkeypatch):
    fail_publish(monkeypatch)
    io = NVRxAsyncCheckpointIO()
    trainer = make_trainer(str(tmp_path / "ckpt"), max_steps=3, io=io, every_n_train_steps=3,
                           save_last=False)
    with pytest.raises(CheckpointSaveError, match=r"step=3\.ckpt failed"):
        trainer.fit(TinyModel())                         # the only save is the last step's
    assert trainer.global_step == 3 and io._checkpointer is None
    assert os.listdir(tmp_path / "ckpt") == []


def test_teardown_on_an_exception_path_logs_the_background_error(tmp_path, monkeypatch, caplog):
    fail_publish(monkeypatch)
    io = NVRxAsyncCheckpointIO()
    io.save_checkpoint({"w": torch.ones(2)}, str(tmp_path / "a.ckpt"))
    with caplog.at_level(logging.ERROR, logger="nvrx.lightning.checkpoint"):
        with pytest.raises(KeyboardInterrupt):
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                io.teardown()                            # as Lightning does on its way out
                raise
    assert "a.ckpt failed" in caplog.text and io._checkpointer is None


@pytest.mark.timeout(240)
def test_a_process_killed_mid_save_keeps_the_previous_checkpoint(tmp_path):
    dirpath, expected, marker = str(tmp_path / "ckpt"), str(tmp_path / "expected.pt"), str(tmp_path / "stalled")
    log = open(tmp_path / "child.log", "w+")
    proc = warm_python.popen([os.path.join(SCRIPTS, "lightning_ckptio_killed.py"), dirpath, expected, marker],
                             stdout=log, stderr=warm_python.STDOUT, cwd=REPO, start_new_session=True,
                             preload=warm_python.LIGHTNING)
    try:
        wait_for(lambda: os.path.exists(marker) or proc.poll() is not None, timeout=180,
                 what="the child's save of last.ckpt to reach its data fsync")
        log.seek(0)
        assert proc.poll() is None, "the child exited before the stalled save:\n" + log.read()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    with open(marker) as f:
        stalled_file = f.read()
    assert os.path.getsize(stalled_file) > 0             # its bytes were written, not published
    assert [n for n in hidden_entries(dirpath) if n.startswith(".last.ckpt.nvrx-partial-")]
    assert is_path_checkpoint(os.path.join(dirpath, "epoch=0-step=4.ckpt"))  # written before it

    io = NVRxAsyncCheckpointIO()
    saved = io.load_checkpoint(os.path.join(dirpath, "last.ckpt"))
    assert saved["global_step"] == 2
    assert_equal_tensors(torch.load(expected), saved["state_dict"])
    resumed = TinyModel()
    make_trainer(dirpath, max_steps=6, io=io).fit(resumed, ckpt_path="last")
    assert resumed.start_step == 2
    assert_equal_tensors(torch.load(expected), resumed.start_weights)
    assert hidden_entries(dirpath) == []                 # the crashed save's leftovers swept
    assert io.load_checkpoint(os.path.join(dirpath, "last.ckpt"))["global_step"] == 6


@pytest.mark.timeout(300)
def test_ddp_only_global_rank_zero_writes_and_every_rank_resumes_from_last(tmp_path):
    dirpath, out = str(tmp_path / "ckpt"), tmp_path / "out"
    out.mkdir()
    log = open(tmp_path / "ddp.log", "w+")
    proc = warm_python.popen([os.path.join(SCRIPTS, "lightning_ckptio_ddp.py"), dirpath, str(out)],
                             stdout=log, stderr=warm_python.STDOUT, cwd=REPO, start_new_session=True,
                             preload=warm_python.LIGHTNING)
    try:
        proc.wait(timeout=280)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
    assert proc.returncode == 0, output
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    # top-k + last at steps 2, 4 (first fit) and 6, 8 (second); steps 2 and 4 removed
    assert ranks[0]["calls"] == {"save": 8, "load": 1, "remove": 2, "started": 8}
    assert ranks[1]["calls"] == {"save": 0, "load": 1, "remove": 0, "started": 0}
    for rank in ranks:
        assert rank["start_step"] == 4 and not rank["writer_after_teardown"]
        assert rank["start_of_second"] == ranks[0]["end_of_first"]
    assert sorted(os.listdir(dirpath)) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]


def test_storage_options(tmp_path):
    io = NVRxAsyncCheckpointIO()
    path = str(tmp_path / "final.ckpt")
    io.save_checkpoint({"w": torch.ones(2)}, path, storage_options={"blocking": True})
    assert is_path_checkpoint(path) and io._checkpointer.pending_paths == []
    with pytest.raises(ConfigError, match="unknown field 'compress'.*known fields: blocking"):
        io.save_checkpoint({"w": torch.ones(2)}, path, storage_options={"compress": True})
    with pytest.raises(ConfigError, match=r"storage_options\['blocking'\]='yes'"):
        io.save_checkpoint({"w": torch.ones(2)}, path, storage_options={"blocking": "yes"})
    with pytest.raises(TypeError, match="storage_options='s3'.*known keys: blocking"):
        io.save_checkpoint({"w": torch.ones(2)}, path, storage_options="s3")
    io.teardown()


def test_bad_input_is_named(tmp_path):
    with pytest.raises(TypeError, match="checkpoint_io="):
        NVRxAsyncCheckpointIO(checkpoint_io="torch")
    with pytest.raises(TypeError, match="checkpoint_io="):
        NVRxAsyncCheckpointIO(checkpoint_io=NVRxAsyncCheckpointIO())
    with pytest.raises(TypeError, match="config="):
        NVRxAsyncCheckpointIO(config=3)
    with pytest.raises(ConfigError, match="config.staging='overlapped'"):
        NVRxAsyncCheckpointIO(config={"staging": "overlapped"})
    with pytest.raises(ConfigError, match="unknown field 'threads'"):
        NVRxAsyncCheckpointIO(config={"threads": 2})
    with pytest.raises(ConfigError, match="writer_threads=0"):
        NVRxAsyncCheckpointIO(config={"writer_threads": 0})
    io = NVRxAsyncCheckpointIO()
    with pytest.raises(TypeError, match="checkpoint: must be a dict"):
        io.save_checkpoint([torch.ones(1)], str(tmp_path / "x.ckpt"))
    with pytest.raises(TypeError, match="path=None"):
        io.save_checkpoint({}, None)
    with pytest.raises(ValueError, match="path='s3://bucket/x.ckpt'"):
        io.save_checkpoint({}, "s3://bucket/x.ckpt")
    io.save_checkpoint({"w": torch.ones(1)}, str(tmp_path / "x.ckpt"))
    with pytest.raises(TypeError, match="map_location="):
        io.load_checkpoint(str(tmp_path / "x.ckpt"), map_location={"cuda:0": "cpu"})
    assert torch.equal(io.load_checkpoint(str(tmp_path / "x.ckpt"), map_location="cpu")["w"], torch.ones(1))
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(str(tmp_path / "missing.ckpt"))
    io.teardown()


def test_resumes_from_a_torch_checkpoint_saved_before_the_plugin(tmp_path):
    dirpath = str(tmp_path / "ckpt")
    first = TinyModel()
    make_trainer(dirpath, max_steps=2, io=pl.plugins.io.TorchCheckpointIO()).fit(first)
    assert os.path.isfile(os.path.join(dirpath, "last.ckpt"))
    second = TinyModel()
    make_trainer(dirpath, max_steps=4, io=NVRxAsyncCheckpointIO()).fit(second, ckpt_path="last")
    assert second.start_step == 2
    assert_equal_tensors(weights(first), second.start_weights)
    assert sorted(os.listdir(dirpath)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert is_path_checkpoint(os.path.join(dirpath, "last.ckpt"))   # the file was replaced
    assert os.path.isfile(os.path.join(dirpath, "epoch=0-step=2.ckpt"))


def test_a_pickled_copy_starts_its_own_writer(tmp_path):
    io = NVRxAsyncCheckpointIO(config={"writer_threads": 1})
    io.save_checkpoint({"w": torch.ones(1)}, str(tmp_path / "a.ckpt"))
    copy = pickle.loads(pickle.dumps(io))                # what spawn-based strategies do
    assert copy._checkpointer is None and copy.config == io.config
    copy.save_checkpoint({"w": torch.zeros(1)}, str(tmp_path / "b.ckpt"), {"blocking": True})
    copy.teardown(), io.teardown()
    assert torch.equal(io.load_checkpoint(str(tmp_path / "a.ckpt"))["w"], torch.ones(1))
