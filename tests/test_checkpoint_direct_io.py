"""The O_DIRECT data-file writer: any mix of aligned and unaligned buffers and sizes ends as
exactly the bytes given, and a filesystem that refuses O_DIRECT still gets the whole file."""

import errno
import fcntl
import os

import pytest
import torch

from nvrx_core.checkpoint import direct_io
from nvrx_core.checkpoint.direct_io import ALIGN, BOUNCE_BYTES, DataFile
from nvrx_core.checkpoint.shards import byte_view


class Views(list):
    """Byte views of fresh uint8 tensors, which it keeps alive (byte_view does not own the
    memory); a non-zero offset makes their addresses unaligned."""

    def __init__(self, sizes, offset_elements=0):
        self.tensors = [torch.randint(0, 256, (size + offset_elements,), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(i))[offset_elements:]
                        for i, size in enumerate(sizes)]
        super().__init__(byte_view(t) for t in self.tensors)


def write_and_read(path, views, direct=True):
    with DataFile(str(path), direct) as out:
        opened_direct = bool(fcntl.fcntl(out.fd, fcntl.F_GETFL) & os.O_DIRECT)
        for view in views:
            out.write(view)
        size = out.finish()
    return opened_direct, size, path.read_bytes()


@pytest.mark.parametrize("sizes, offset", [
    ([ALIGN * 4, ALIGN * 2], 0),                    # all aligned: straight from the buffers
    ([1], 0),                                       # one byte: a padded block, truncated back
    ([ALIGN - 1, ALIGN + 1, ALIGN, 3], 0),          # sizes that break the file offset's alignment
    ([ALIGN * 3, 5, ALIGN * 2], 1),                 # unaligned addresses: through the bounce buffer
    ([BOUNCE_BYTES + 3, ALIGN * 2, 7], 0),          # the bounce buffer fills and empties on the way
])
def test_the_file_holds_exactly_the_bytes_written(tmp_path, sizes, offset):
    views = Views(sizes, offset)
    opened_direct, size, data = write_and_read(tmp_path / "f", views)
    assert opened_direct, "this test's filesystem (under /tmp) takes O_DIRECT: the direct path is the one tested"
    assert size == sum(sizes) == len(data)
    assert data == b"".join(bytes(v) for v in views)


def test_buffered_when_asked(tmp_path):
    views = Views([ALIGN + 7, 9])
    opened_direct, size, data = write_and_read(tmp_path / "f", views, direct=False)
    assert not opened_direct and size == len(data) == ALIGN + 16
    assert data == b"".join(bytes(v) for v in views)


def test_the_file_must_be_new(tmp_path):
    (tmp_path / "f").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        DataFile(str(tmp_path / "f"), True)
    assert (tmp_path / "f").read_bytes() == b"old"


# Every filesystem here accepts O_DIRECT (tmpfs too, on this kernel), so a refusal cannot be
# had for real: these two tests make fcntl or the first direct write answer EINVAL, as a
# filesystem without O_DIRECT support (or with a larger block than ALIGN) does.

def test_refused_at_open_the_file_is_written_through_the_page_cache(tmp_path, monkeypatch):
    real = fcntl.fcntl

    def refuse_direct(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct_io.fcntl, "fcntl", refuse_direct)
    views = Views([ALIGN * 2, 3])
    opened_direct, size, data = write_and_read(tmp_path / "f", views)
    assert not opened_direct and size == ALIGN * 2 + 3
    assert data == b"".join(bytes(v) for v in views)


@pytest.mark.parametrize("sizes", [[ALIGN * 2, 5], [5, ALIGN]])  # refused: a straight write, the tail
def test_refused_at_the_first_write_the_rest_goes_through_the_page_cache(tmp_path, monkeypatch, sizes):
    real_write = os.write
    refused = []

    def write(fd, data):
        if not refused and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", write)
    views = Views(sizes)
    with DataFile(str(tmp_path / "f"), True) as out:
        for view in views:
            out.write(view)
        size = out.finish()
        assert not out.direct and not fcntl.fcntl(out.fd, fcntl.F_GETFL) & os.O_DIRECT
    assert refused and size == sum(sizes)
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(v) for v in views)


def test_a_checkpoint_written_directly_equals_one_written_through_the_page_cache(tmp_path):
    from nvrx_core.checkpoint import AsyncCheckpointer, CheckpointConfig, read_manifest

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 37), torch.nn.Linear(37, 3))  # sizes off every block
    state = {"model": model.state_dict(), "step": torch.tensor(7), "half": torch.randn(513).half()}
    manifests = {}
    for direct in (True, False):
        ckpt = AsyncCheckpointer(str(tmp_path / str(direct)), CheckpointConfig(direct_io=direct),
                                 process_group=None)
        ckpt.save(state, 1)
        ckpt.finalize(blocking=True)
        loaded = ckpt.load(1)
        ckpt.close()
        assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
        assert torch.equal(loaded["half"], state["half"]) and loaded["step"] == 7
        manifests[direct] = {n: (e.size, e.checksum)
                             for n, e in read_manifest(ckpt.store.path(1)).files.items() if ".data" in n}
    assert manifests[True] == manifests[False] and manifests[True]


def test_direct_io_must_be_a_bool():
    from nvrx_core.checkpoint import CheckpointConfig
    from nvrx_core.config import ConfigError

    with pytest.raises(ConfigError, match="direct_io"):
        CheckpointConfig(direct_io="yes")
