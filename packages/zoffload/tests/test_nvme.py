"""NVMe files: damaged files are refused by name, a crash mid-write leaves nothing loadable."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch

import zoffload
from zoffload import _layout, _nvme

from .conftest import swap_files


def offload_some(offloader, **kwargs):
    tensors = {"a": torch.randn(100_000), "b": torch.arange(5000), "c": torch.randn(7)}
    expected = {k: v.clone() for k, v in tensors.items()}
    return tensors, expected, offloader.offload(tensors, "nvme", **kwargs)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_file_is_checked_and_described(offloader):
    tensors, expected, handle = offload_some(offloader)
    assert handle.path is not None
    manifest = zoffload.check_file(handle.path)
    assert manifest.data_offset % 4096 == 0
    assert manifest.file_nbytes == handle.path.stat().st_size
    assert [e.names for e in manifest.storages] == [("a",), ("b",), ("c",)]
    assert len(manifest.chunk_crcs) > 1  # 64 KiB chunks: several requests
    handle.reload()
    assert all(torch.equal(tensors[k], expected[k]) for k in tensors)


def test_direct_io_where_the_filesystem_allows_it(offloader, tmp_path):
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
        supported = hasattr(os, "O_DIRECT")
    except OSError:
        supported = False
    _, _, handle = offload_some(offloader)
    assert handle.direct_io is supported
    handle.reload()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="Linux only")
def test_no_o_direct_falls_back_to_buffered_io_with_a_note(offloader, monkeypatch, caplog):
    # A filesystem that refuses O_DIRECT (tmpfs before Linux 6.6, many network and overlay
    # filesystems), simulated: the real one under tmp_path may well accept it.
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level("INFO", logger="zoffload"):
        tensors, expected, handle = offload_some(offloader)
    assert handle.direct_io is False
    assert "no O_DIRECT" in caplog.text
    assert str(offloader.nvme_path) in caplog.text
    handle.reload()
    assert all(torch.equal(tensors[k], expected[k]) for k in tensors)
    strict = zoffload.Offloader(pool=offloader.pool, nvme_path=offloader.nvme_path, direct_io=True)
    with pytest.raises(zoffload.OffloadError, match="O_DIRECT"):
        strict.offload({"x": torch.ones(4)}, "nvme")
    assert not swap_files(offloader.nvme_path)


def test_missing_file_is_named_and_the_handle_stays_offloaded(offloader):
    tensors, expected, handle = offload_some(offloader)
    path = handle.path
    assert path is not None
    moved = path.with_suffix(".away")
    path.rename(moved)
    with pytest.raises(zoffload.OffloadFileError, match="missing") as info:
        handle.reload()
    assert info.value.path == path
    assert str(path) in str(info.value)
    assert handle.state == "offloaded"
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
    moved.rename(path)  # put it back: the reload can be retried
    handle.reload()
    assert all(torch.equal(tensors[k], expected[k]) for k in tensors)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("data", "chunk 1 .* fails its checksum"),
        ("header", "header is corrupt"),
        ("magic", "no zoffload header"),
        ("truncate", "truncated"),
        ("append", "longer than its header says"),
    ],
)
def test_damaged_files_are_refused_by_name(offloader, damage, message):
    tensors, _, handle = offload_some(offloader)
    path = handle.path
    assert path is not None
    manifest = zoffload.check_file(path)
    if damage == "data":
        flip(path, manifest.data_offset + manifest.chunk_bytes + 10)
    elif damage == "header":
        flip(path, 40)
    elif damage == "magic":
        flip(path, 0)
    elif damage == "truncate":
        os.truncate(path, manifest.file_nbytes - 4096)
    else:
        with open(path, "ab") as f:
            f.write(b"\0" * 4096)
    with pytest.raises(zoffload.OffloadFileError, match=message) as info:
        handle.reload()
    assert str(path) in str(info.value)
    with pytest.raises(zoffload.OffloadFileError, match=message):
        zoffload.check_file(path)
    assert handle.state == "offloaded"  # nothing half-filled is taken for good data
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())


def test_a_file_of_another_offload_is_refused(offloader):
    _, _, first = offload_some(offloader)
    _, _, second = offload_some(offloader)
    assert first.path is not None
    assert second.path is not None
    os.replace(second.path, first.path)
    with pytest.raises(zoffload.OffloadFileError, match="another offload"):
        first.reload()


def test_a_failed_write_leaves_no_file_and_the_tensors_intact(offloader, monkeypatch):
    calls = 0
    real = _nvme._pwrite_all

    def failing(fd, data, offset):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise OSError(28, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(_nvme, "_pwrite_all", failing)
    tensors = {"a": torch.randn(100_000)}
    expected = tensors["a"].clone()
    with pytest.raises(zoffload.NvmeSpaceError, match="No space"):
        offloader.offload(tensors, "nvme")
    assert torch.equal(tensors["a"], expected)  # never freed
    assert zoffload.handle_of(tensors["a"]) is None
    assert not swap_files(offloader.nvme_path)  # no final file, no temporary left
    # The same failure, non-blocking: reported by wait(), tensors intact.
    calls = 0
    handle = offloader.offload(tensors, "nvme", non_blocking=True)
    with pytest.raises(zoffload.NvmeSpaceError, match="No space"):
        handle.wait()
    assert handle.state == "resident"
    assert torch.equal(tensors["a"], expected)


_CRASH = """
import os, signal, sys, torch, zoffload
from zoffload import _layout, _nvme
real, calls = _nvme._pwrite_all, [0]
def dying(fd, data, offset):
    calls[0] += 1
    if calls[0] == 6:  # mid-way through the data, before the header
        os.kill(os.getpid(), signal.SIGKILL)
    real(fd, data, offset)
_nvme._pwrite_all = dying
off = zoffload.Offloader(nvme_path=sys.argv[1], chunk_bytes=64 << 10)
off.offload({"x": torch.randn(1 << 20)}, "nvme")
print("not reached")
"""


def test_a_process_killed_mid_write_leaves_nothing_loadable(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CRASH), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    left = swap_files(tmp_path)
    assert left, "the crashed write should have left its temporary file"
    assert all(".tmp-" in f.name for f in left)  # never the final name
    for f in left:
        with pytest.raises(zoffload.OffloadFileError, match="no zoffload header") as info:
            zoffload.check_file(f)
        assert str(f) in str(info.value)


def _staged_bytes(monkeypatch) -> list[int]:
    """Counts the bytes copied through staging buffers (the rest moves in place)."""
    counted = [0]
    real = _nvme.NvmeIO._copy_all

    def counting(self, copies, fences):
        counted[0] += sum(dst.numel() for dst, _ in copies)
        real(self, copies, fences)

    monkeypatch.setattr(_nvme.NvmeIO, "_copy_all", counting)
    return counted


@pytest.mark.parametrize("direct_io", [None, False])
def test_large_host_storages_move_in_place_but_for_their_ends(tmp_path, monkeypatch, direct_io):
    off = zoffload.Offloader(
        pool=zoffload.HostPool(), nvme_path=tmp_path, chunk_bytes=1 << 20, direct_io=direct_io
    )
    staged = _staged_bytes(monkeypatch)
    big = torch.randn(10 << 20)[5:]  # 40 MiB, viewed from an offset
    tensors = {"big": big, "small": torch.arange(7)}
    expected = {k: v.clone() for k, v in tensors.items()}
    handle = off.offload(tensors, "nvme")
    assert handle.path is not None
    (entry, _) = zoffload.check_file(handle.path).storages
    ends = 2 * 4096 + 56  # the unaligned head and tail, and the small one
    assert 0 < staged[0] <= ends
    staged[0] = 0
    handle.reload()
    # In place again where the new allocation lines up with the file as the old one did (in
    # practice, for allocations this large) or with buffered I/O, which needs no alignment.
    if direct_io is False or big.untyped_storage().data_ptr() % 4096 == entry.offset % 4096:
        assert 0 < staged[0] <= ends
    assert all(torch.equal(tensors[k], expected[k]) for k in tensors)
    off.close()
    off.pool.close()


def test_storages_that_do_not_line_up_go_through_staging(offloader, monkeypatch):
    # An allocator that placed the storage elsewhere in its page at reload than at offload
    # is simulated by a layout placed out of line from the start.
    # An odd offset lines up with no memory alignment that O_DIRECT has.
    real = _layout._in_block
    monkeypatch.setattr(_layout, "_in_block", lambda slot, a: (real(slot, a) + 1) % a)
    staged = _staged_bytes(monkeypatch)
    tensors = {"big": torch.randn(1 << 20)}
    expected = tensors["big"].clone()
    handle = offloader.offload(tensors, "nvme")
    direct = handle.direct_io
    handle.reload()
    if direct:  # (buffered I/O has no alignment to keep: in place all the same)
        assert staged[0] == 2 * (4 << 20)
    assert torch.equal(tensors["big"], expected)


def test_corruption_read_in_place_is_refused_and_nothing_is_kept(offloader):
    tensors = {"big": torch.randn(1 << 20)}
    handle = offloader.offload(tensors, "nvme")
    assert handle.path is not None
    manifest = zoffload.check_file(handle.path)
    (entry,) = manifest.storages
    flip(handle.path, manifest.data_offset + entry.offset + (2 << 20) + 12345)
    with pytest.raises(zoffload.OffloadFileError, match=r"chunk \d+ .* fails its checksum"):
        handle.reload()
    assert handle.state == "offloaded"
    assert tensors["big"].untyped_storage().nbytes() == 0


def _held_open(path):
    """Descriptors of this process on ``path`` after its name went ([Note: deferred free])."""
    fds = Path("/proc/self/fd")
    links = []
    for fd in fds.iterdir():
        try:
            links.append(os.readlink(fd))
        except OSError:  # the listing's own descriptor, closed since
            continue
    return [link for link in links if link == f"{path} (deleted)"]


def test_remove_frees_the_name_at_once_and_the_file_by_close(offloader):
    _, _, handle = offload_some(offloader)
    path = handle.path
    assert path is not None
    offloader.io.remove(path)
    assert not path.exists()  # a new offload may take the name now
    offloader.io.remove(path)  # gone already: nothing to do
    assert not swap_files(offloader.nvme_path)  # the folder may be deleted at once
    offloader.io.close()
    assert not _held_open(path)  # the last close ran: the blocks are freed


def test_reload_and_rewrite_leave_no_file_behind_once_removals_are_done(offloader):
    tensors, expected, handle = offload_some(offloader)
    first = handle.path
    handle.reload(keep=True)
    tensors["a"].add_(1)
    handle.offload()  # a new file replaces the kept one under the same name
    assert handle.path == first
    assert len(swap_files(offloader.nvme_path)) == 1
    handle.reload()
    assert not swap_files(offloader.nvme_path)  # the name went with the reload
    offloader.io.wait_removals()
    assert not _held_open(first)  # the replaced file and the reloaded one are both freed
    assert torch.equal(tensors["a"], expected["a"] + 1)


def test_the_crc_is_zlibs_whichever_implementation_computes_it():
    data = memoryview(bytes(range(256)) * 1000)
    assert _nvme._crc([data[:1000], data[1000:]]) == zlib.crc32(data)
    assert _nvme._zeros_crc(8192) == zlib.crc32(bytes(8192))


def test_a_forked_child_does_not_wait_for_the_parents_removals(offloader):
    import threading
    import time

    from zoffload import _deferred

    _, _, handle = offload_some(offloader)
    path = handle.path
    assert path is not None
    handle.reload(keep=True)
    hold = threading.Event()
    _deferred.close_later(os.open(os.devnull, os.O_RDONLY))  # starts the remover thread
    _deferred.wait()
    assert _deferred._executor is not None
    _deferred._executor.submit(hold.wait)  # the remover is busy: the next close waits
    handle.discard_copy()  # the file's close is pending now
    try:
        pid = os.fork()
        if pid == 0:  # the child: no remover thread, its copy of the descriptor closed
            os._exit(0 if zoffload.free_bytes(path.parent) is not None else 1)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done[0] == pid, "the child hung"
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        hold.set()
    offloader.io.wait_removals()
    assert not _held_open(path)


def test_scratch_files_skip_the_fsyncs_and_come_back_the_same(offloader, monkeypatch):
    # [Note: scratch files]: durable=False, at the first offload and every rewrite
    offload_some(offloader)  # the swap folder claimed (its marker is synced)
    synced: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)  # _nvme calls os.fsync
    tensors, expected, handle = offload_some(offloader, durable=False)
    assert handle.path is not None
    assert not synced
    handle.reload(keep=True)
    tensors["a"].add_(1)
    handle.offload(rewrite=True)
    assert not synced
    _nvme.check_file(handle.path)  # header, size and every chunk's CRC, as a durable file's
    handle.reload()
    assert torch.equal(tensors["a"], expected["a"] + 1)
    assert torch.equal(tensors["b"], expected["b"])
    offload_some(offloader)  # durable (the default): the file and its folder synced
    assert len(synced) == 2


def test_reclaim_gives_the_memory_back_unread_and_drops_the_file(offloader):
    # for a caller about to overwrite every byte (an optimizer step's shard)
    tensors, expected, handle = offload_some(offloader, durable=False)
    path = handle.path
    handle.reclaim()
    assert handle.state == "resident"
    assert handle.path is None
    assert path is not None
    assert not path.exists()
    assert all(t.untyped_storage().nbytes() == e.untyped_storage().nbytes() for t, e in
               zip(tensors.values(), expected.values(), strict=True))  # fmt: skip
    for name, value in expected.items():
        tensors[name].copy_(value * 2)
    handle.offload(rewrite=False)  # no copy to keep: written anew all the same
    handle.reload()
    assert all(torch.equal(tensors[k], v * 2) for k, v in expected.items())
    with pytest.raises(zoffload.OffloadError, match="reclaim: the handle is resident"):
        handle.reclaim()
