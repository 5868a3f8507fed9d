"""AsyncCheckpointer in one process: round trip, snapshot semantics, corruption, retention,
abort, stale completions, failures and config errors. Real files, real background threads."""

import collections
import os
import time

import pytest
import torch

from nvrx_core.checkpoint import (CHECKPOINT_ABORTED, CHECKPOINT_FAILED, CHECKPOINT_SKIPPED,
                                  AsyncCheckpointer, CheckpointConfig, CheckpointCorruptError, CheckpointError,
                                  CheckpointNotFoundError, CheckpointSaveError, read_manifest,
                                  verify_checkpoint)
from nvrx_core.checkpoint import pipeline
from nvrx_core.checkpoint.staging import HostStager
from nvrx_core.config import ConfigError
from nvrx_core.events import CHECKPOINT_COMMITTED, EventLog, read_events
from harness import wait_for

Pair = collections.namedtuple("Pair", "first second")


def assert_same(expected, actual, path="root"):
    assert type(expected) is type(actual), f"{path}: {type(expected)} != {type(actual)}"
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, path
        assert torch.equal(expected, actual), path
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), path
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), path
        for i, (a, b) in enumerate(zip(expected, actual)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert expected == actual, path


def trained_state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        optim.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def rich_state():
    shared = torch.arange(6, dtype=torch.float32)
    return {
        **trained_state(),
        "dtypes": {str(d): torch.ones(3, dtype=d) for d in
                   (torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.bool,
                    torch.complex64)},
        "strided": torch.arange(24.0).reshape(4, 6).t(),   # non-contiguous
        "conj": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),   # lazy view bit
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
        "tied": [shared, shared],
        "nested": {"a": {"b": [1, 2.5, "x", None, (True, torch.tensor([7]))]}},
        "ordered": collections.OrderedDict(z=1, a=torch.zeros(2)),
        "rng": torch.get_rng_state(),
    }


def committed_dirs(root):
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


def leftovers(root):
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def test_round_trip_preserves_tensors_containers_and_optimizer_state(tmp_path):
    state = rich_state()
    with AsyncCheckpointer(str(tmp_path), process_group=None) as ckpt:
        assert ckpt.save(state, 7) == 1
        assert ckpt.finalize(blocking=True) == [7]
        step, loaded = ckpt.load_latest()
    assert step == 7
    expected = dict(state, strided=state["strided"].contiguous())
    assert_same(expected, loaded)
    assert loaded["tied"][0] is loaded["tied"][1]
    manifest = verify_checkpoint(str(tmp_path / "step_0000000007"))
    assert manifest.step == 7 and manifest.world_size == 1 and manifest.generation == 1
    assert sorted(manifest.ranks[0]) == sorted(manifest.files)
    assert all(e.checksum is not None for e in manifest.files.values())


def test_save_returns_a_snapshot_later_mutation_is_not_saved(tmp_path):
    weights = torch.zeros(1 << 20)
    with AsyncCheckpointer(str(tmp_path), process_group=None) as ckpt:
        ckpt.save({"w": weights}, 1)
        weights.add_(5)   # training continues while the write is in flight
        ckpt.finalize(blocking=True)
        assert torch.equal(ckpt.load(1)["w"], torch.zeros(1 << 20))


def test_staging_buffers_are_reused_across_saves():
    stager = HostStager(pin_memory=True, max_sets=1)
    state = {"a": torch.randn(1000), "b": torch.randn(10, 10)}
    first = stager.stage(state)
    pointers = [t.data_ptr() for t in first.tensors]
    stager.release(first)
    second = stager.stage(state)
    assert [t.data_ptr() for t in second.tensors] == pointers
    assert not any(t.is_pinned() for t in second.tensors)  # CPU sources: no pinning needed
    other = stager.stage({"a": torch.randn(5)})            # held set: a fresh buffer
    assert other.tensors[0].data_ptr() not in pointers


def test_flipped_bytes_are_detected_and_the_previous_checkpoint_is_loaded(tmp_path):
    events_file = str(tmp_path / "events.jsonl")
    root = tmp_path / "ckpt"
    events = EventLog(events_file, rank=0)
    with AsyncCheckpointer(str(root), process_group=None, events=events) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": torch.full((4096,), float(step))}, step)
            ckpt.finalize(blocking=True)
    data = root / "step_0000000002" / "rank_00000.data0"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match="rank_00000.data0: checksum"):
        verify_checkpoint(str(root / "step_0000000002"))
    ckpt = AsyncCheckpointer(str(root), process_group=None, events=events)
    step, state = ckpt.load_latest()
    assert step == 1 and torch.equal(state["w"], torch.full((4096,), 1.0))
    skipped = [e for e in read_events(events_file) if e["kind"] == CHECKPOINT_SKIPPED]
    assert [e["step"] for e in skipped] == [2] and "checksum" in skipped[0]["reason"]
    assert [e["step"] for e in read_events(events_file) if e["kind"] == CHECKPOINT_COMMITTED] == [1, 2]


@pytest.mark.parametrize("damage", ["truncate", "no_manifest", "bad_manifest", "missing_file"])
def test_partial_or_damaged_checkpoints_are_skipped(tmp_path, damage):
    with AsyncCheckpointer(str(tmp_path), process_group=None) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": torch.full((1000,), float(step)), "meta": {"step": step}}, step)
        ckpt.finalize(blocking=True)
    newest = tmp_path / "step_0000000002"
    if damage == "truncate":
        with open(newest / "rank_00000.data0", "r+b") as f:
            f.truncate(10)
    elif damage == "no_manifest":
        (newest / "manifest.json").unlink()
    elif damage == "bad_manifest":
        (newest / "manifest.json").write_text("{not json")
    else:
        (newest / "rank_00000.index").unlink()
    step, state = AsyncCheckpointer(str(tmp_path), process_group=None).load_latest()
    assert step == 1 and state["meta"] == {"step": 1}


def test_no_loadable_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path)):
        AsyncCheckpointer(str(tmp_path), process_group=None).load_latest()


def test_retention_keeps_the_last_k(tmp_path):
    with AsyncCheckpointer(str(tmp_path), CheckpointConfig(keep_last=2), process_group=None) as ckpt:
        for step in range(1, 6):
            ckpt.save({"step": torch.tensor(step)}, step)
            ckpt.finalize(blocking=True)
        assert ckpt.latest_step() == 5
    assert committed_dirs(tmp_path) == ["step_0000000004", "step_0000000005"]
    assert leftovers(tmp_path) == []


def test_finalize_without_blocking_commits_once_the_write_is_done(tmp_path):
    with AsyncCheckpointer(str(tmp_path), process_group=None) as ckpt:
        ckpt.save({"w": torch.randn(1 << 18)}, 3)
        deadline = time.monotonic() + 60
        committed = []
        while not committed and time.monotonic() < deadline:
            committed = ckpt.finalize()
            time.sleep(0.01)
        assert committed == [3] and ckpt.pending_steps == []


def test_more_saves_than_max_pending_wait_for_the_oldest(tmp_path):
    config = CheckpointConfig(max_pending_saves=2)
    with AsyncCheckpointer(str(tmp_path), config, process_group=None) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"w": torch.full((1 << 16,), float(step))}, step)
            assert len(ckpt.pending_steps) <= 2
        ckpt.finalize(blocking=True)
        assert [ckpt.load(s)["w"][0].item() for s in (1, 2, 3)] == [1.0, 2.0, 3.0]


def big_state(megabytes=64, value=1.0):
    return {f"t{i}": torch.full((1 << 18,), value) for i in range(megabytes)}


class CancelledMidWrite:
    """A save's cancellation flag as its writer sees it: from the writer's second check on
    (its first chunk is written), each check waits until abort() has cancelled the save."""

    def __init__(self, cancel):
        self.cancel, self.checks = cancel, 0

    def is_set(self):
        self.checks += 1
        if self.checks > 1:
            assert self.cancel.wait(120), "abort() never cancelled the save"
        return self.cancel.is_set()


def hold_writes_until_aborted(monkeypatch):
    """Every save from now on is still being written when abort() comes: a fast worker
    cannot have committed it first (abort() would then rightly return [])."""
    real = pipeline.write_shard

    def write_shard(staged, directory, rank, pool, threads, checksum, chunk_bytes, cancel, *rest):
        return real(staged, directory, rank, pool, threads, checksum, chunk_bytes,
                    CancelledMidWrite(cancel), *rest)

    monkeypatch.setattr(pipeline, "write_shard", write_shard)


def test_abort_stops_the_save_and_leaves_no_partial_directory(tmp_path, monkeypatch):
    config = CheckpointConfig(chunk_bytes=1 << 16, writer_threads=1)
    with AsyncCheckpointer(str(tmp_path), config, process_group=None) as ckpt:
        ckpt.save({"w": torch.ones(10)}, 1)
        ckpt.finalize(blocking=True)
        hold_writes_until_aborted(monkeypatch)
        ckpt.save(big_state(), 2)
        assert ckpt.abort() == [2]
        assert leftovers(tmp_path) == [] and committed_dirs(tmp_path) == ["step_0000000001"]
        assert ckpt.finalize(blocking=True) == []
        monkeypatch.undo()
        ckpt.save({"w": torch.full((10,), 3.0)}, 3)   # the checkpointer keeps working
        assert ckpt.finalize(blocking=True) == [3]
    assert leftovers(tmp_path) == []


def test_a_stale_completion_never_commits_a_newer_save(tmp_path, monkeypatch):
    config = CheckpointConfig(chunk_bytes=1 << 16, writer_threads=1)
    with AsyncCheckpointer(str(tmp_path), config, process_group=None) as ckpt:
        hold_writes_until_aborted(monkeypatch)
        first = ckpt.save(big_state(value=1.0), 5)
        ckpt.abort(timeout=0)            # disowned: its completion will arrive later
        monkeypatch.undo()
        second = ckpt.save(big_state(value=2.0), 5)
        assert second > first
        assert ckpt.finalize(blocking=True) == [5]
        assert ckpt.stale_completions == 1
        loaded = ckpt.load(5)
    assert read_manifest(str(tmp_path / "step_0000000005")).generation == second
    assert all(torch.equal(t, torch.full((1 << 18,), 2.0)) for t in loaded.values())
    assert leftovers(tmp_path) == []


def test_abort_without_waiting_keeps_a_save_whose_result_has_arrived(tmp_path):
    """abort(timeout=0) waits for nothing, but a save that is committed and whose result is
    already back is not reported aborted (it was: the zero wait looked at no result)."""
    events_file = str(tmp_path / "events.jsonl")
    with AsyncCheckpointer(str(tmp_path / "ckpt"), process_group=None, events=EventLog(events_file)) as ckpt:
        ckpt.save({"w": torch.ones(4)}, 5)
        # the result queue is private: no public call shows a result arrived without collecting it
        results = ckpt._saves.pipeline._results
        wait_for(lambda: results.qsize() == 1, 120, "the save's result to reach the training thread")
        assert ckpt.abort(timeout=0) == []
        assert ckpt.stale_completions == 0
        assert committed_dirs(tmp_path / "ckpt") == ["step_0000000005"]
    assert [e for e in read_events(events_file) if e["kind"] == CHECKPOINT_ABORTED] == []


def test_a_failed_background_save_raises_in_finalize(tmp_path):
    root = tmp_path / "ckpt"
    ckpt = AsyncCheckpointer(str(root), process_group=None)
    ckpt.save({"w": torch.ones(4)}, 1)
    ckpt.finalize(blocking=True)
    os.rename(root, tmp_path / "moved")
    root.write_text("not a directory")          # the next save cannot create its directory
    ckpt.save({"w": torch.ones(4)}, 2)
    with pytest.raises(CheckpointSaveError, match="step 2"):
        ckpt.finalize(blocking=True)
    assert ckpt.pending_steps == []
    ckpt.close()


def test_a_failed_save_can_be_non_fatal(tmp_path):
    events_file = str(tmp_path / "events.jsonl")
    root = tmp_path / "ckpt"
    config = CheckpointConfig(fail_on_save_error=False)
    ckpt = AsyncCheckpointer(str(root), config, process_group=None, events=EventLog(events_file))
    ckpt.save({"w": torch.ones(4)}, 1)
    ckpt.finalize(blocking=True)
    (root / "step_0000000001").rename(tmp_path / "kept")
    os.rmdir(root)
    root.write_text("not a directory")
    ckpt.save({"w": torch.ones(4)}, 2)
    assert ckpt.finalize(blocking=True) == []
    failed = [e for e in read_events(events_file) if e["kind"] == CHECKPOINT_FAILED]
    assert [e["step"] for e in failed] == [2] and "Error" in failed[0]["error"]
    root.unlink()
    root.mkdir()                                 # storage is back: the same worker goes on
    (tmp_path / "kept").rename(root / "step_0000000001")
    ckpt.save({"w": torch.full((4,), 3.0)}, 3)
    assert ckpt.finalize(blocking=True) == [3]
    assert ckpt.store.steps() == [1, 3] and ckpt.load_latest()[0] == 3
    ckpt.close()


def test_unsupported_tensors_and_bad_steps_are_rejected_clearly(tmp_path):
    with AsyncCheckpointer(str(tmp_path), process_group=None) as ckpt:
        with pytest.raises(CheckpointError, match=r"layers\.0.*layout=torch.sparse_coo"):
            ckpt.save({"layers": [torch.eye(3).to_sparse()]}, 1)
        with pytest.raises(CheckpointError, match="step=-1"):
            ckpt.save({"w": torch.ones(1)}, -1)
        assert ckpt.pending_steps == []


class Custom:
    def __init__(self, value):
        self.value = value


def test_objects_outside_the_weights_only_allow_list_need_an_explicit_opt_in(tmp_path):
    with AsyncCheckpointer(str(tmp_path), process_group=None) as ckpt:
        ckpt.save({"obj": Custom(3), "pair": Pair(torch.ones(2), "two")}, 1)
        ckpt.finalize(blocking=True)
        with pytest.raises(CheckpointError, match="weights_only=False"):
            ckpt.load(1)
        loaded = ckpt.load(1, weights_only=False)
    assert loaded["obj"].value == 3
    assert_same(Pair(torch.ones(2), "two"), loaded["pair"])


def test_leftovers_of_a_crashed_run_are_removed_on_start(tmp_path):
    crashed = tmp_path / ".partial-step_0000000009-00000000000000ab-g1"
    crashed.mkdir()
    (crashed / "rank_00000.data0").write_bytes(b"x" * 10)
    AsyncCheckpointer(str(tmp_path), process_group=None)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("field,value,rule", [
    ("writer_threads", 0, r"\[1, 64\]"),
    ("keep_last", -1, ">= 0"),
    ("checksum", "md5", "crc32, adler32, none"),
    ("max_pending_saves", 0, r"\[1, 8\]"),
    ("chunk_bytes", 10, "65536"),
    ("staging", "eager", "blocking, overlapped"),
])
def test_config_errors_name_field_value_and_rule(field, value, rule):
    with pytest.raises(ConfigError, match=rf"{field}={value!r}: .*{rule}"):
        CheckpointConfig(**{field: value})


def test_config_loads_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  keep_last: 5\n  checksum: adler32\n")
    config = CheckpointConfig.from_sources(str(path), {"writer_threads": 4})
    assert (config.keep_last, config.checksum, config.writer_threads) == (5, "adler32", 4)
    path.write_text("checkpoint:\n  keep_lst: 5\n")
    with pytest.raises(ConfigError, match="unknown field 'keep_lst'"):
        CheckpointConfig.from_sources(str(path))


def test_preset_yaml_is_valid():
    preset = os.path.join(os.path.dirname(__file__), "..", "configs", "checkpoint.yaml")
    from nvrx_core.checkpoint import LocalCheckpointConfig
    from nvrx_core.preemption import PreemptionConfig

    assert CheckpointConfig.from_sources(preset) == CheckpointConfig()
    assert LocalCheckpointConfig.from_sources(preset) == LocalCheckpointConfig()
    assert PreemptionConfig.from_sources(preset) == PreemptionConfig()


def test_a_shard_split_over_several_writer_threads_reads_back_verified(tmp_path):
    import concurrent.futures
    import threading

    from nvrx_core.checkpoint.layout import Checksum
    from nvrx_core.checkpoint.shards import read_shard, write_shard

    state = {f"t{i}": torch.randn(1000 * (i + 1)) for i in range(7)}
    staged = HostStager().stage(state)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        entries = write_shard(staged, str(tmp_path), 4, pool, threads=3, checksum_algo="adler32",
                              chunk_bytes=1 << 16, cancel=threading.Event())
        names = sorted(e.name for e in entries)
        assert names == ["rank_00004.data0", "rank_00004.data1", "rank_00004.data2",
                         "rank_00004.index"]
        sizes = [e.size for e in entries if ".data" in e.name]
        assert sum(sizes) == staged.nbytes and max(sizes) - min(sizes) <= 7000 * 4  # balanced
        for entry in entries:
            checksum = Checksum("adler32")
            checksum.update((tmp_path / entry.name).read_bytes())
            assert checksum.value == entry.checksum
        loaded = read_shard(str(tmp_path), 4, {e.name: e for e in entries}, "adler32", pool=pool)
    assert_same(state, loaded)
