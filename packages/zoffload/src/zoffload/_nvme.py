"""Offload files on NVMe: large aligned I/O, several requests in flight, crash-safe.

[Note: file format]
One file per handle: a header, then the handle's layout (see `_layout.plan`) as data::

    [0, 24)          b"ZOFFLOAD", version (u32), manifest length (u64), manifest CRC-32 (u32)
    [24, ...)        the manifest, JSON: token, data offset and size, chunk size, the CRC-32
                     of every chunk, and every storage (names, offset, size, zero runs)
    [H, H + D)       the data, H and D multiples of 4096

Version 2 added each storage's zero runs (storage-relative ``[start, stop)`` byte ranges that
the data holds as zeros and a reload hands back instead of writing, see [Note: extents] in
``_extents``); version 1 files (no zero runs) are still read. A chunk of zeros only may be a
hole in the file.

Data moves in chunks (``chunk_bytes``, default 8 MiB), ``threads`` of them in flight at
once, through O_DIRECT where the filesystem allows it (bypassing the page cache, so
offloading 100 GB does not push everything else out of memory). The interior of a large host
storage is read and written in place, the rest through page-aligned staging buffers (pinned
when a GPU is involved): see [Note: extents] in ``_extents``. Filesystems that refuse
O_DIRECT (tmpfs, some overlay and network filesystems) get the same I/O buffered, noted once
in the log.

[Note: crash safety]
The file is written under a temporary name, the header last (until then it is zeros, so a
torn file has no magic), then fsync, an atomic rename to the final name and an fsync of the
directory. A crash leaves at most a ``*.tmp-*`` file that nothing loads (and the blocks of
a file being deleted, see [Note: deferred free], which the filesystem frees at its next
mount). Reading checks the magic, the manifest's CRC, that the manifest belongs to this
handle, the exact file size and every chunk's CRC before a byte is trusted, and names the
file in the error otherwise.

[Note: scratch files]
A file only its own process reads back (``durable=False``: a training engine's swap, whose
folder the next job removes after a crash, [Note: swap folders]) skips the two fsyncs: the
data is on the device once its O_DIRECT writes return (in the page cache otherwise, where the
same process reads it), the rename is atomic either way, and a crash loses nothing anyone
could load. Each fsync commits the filesystem's journal (the fallocated extents, the size,
the rename): on this VM's disk 10-20 ms a file, beside the disk's other traffic. An engine's
parameter shards are one small file per module, rewritten every step on the step's critical
path: at 39 M parameters (65 files) the step waited 1.37 s on those writes with the fsyncs
and 0.88 s without (probe, world size 1). The header is still written last and every chunk
still carries its CRC, so what a reload trusts is checked the same.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import torch

from zoffload import _deferred
from zoffload._errors import NvmeSpaceError, OffloadError, OffloadFileError
from zoffload._extents import BLOCK, Alignment, Chunk, find_zero_runs, plan_chunks
from zoffload._layout import Layout, align_up
from zoffload._pages import release_pages
from zoffload._pool import HostPool, HostRegion
from zoffload._space import free_bytes, free_bytes_now, nvme_error
from zoffload._stats import COUNTERS
from zoffload._storage import Slot, byte_view

__all__ = ["FileManifest", "NvmeIO", "StorageEntry", "check_file"]

_log = logging.getLogger("zoffload")

MAGIC = b"ZOFFLOAD"
VERSION = 2
_READABLE = (1, 2)  # versions this zoffload reads (see [Note: file format])
_PREFIX = struct.Struct("<8sIQI")
_BLOCK = BLOCK  # file offsets and I/O sizes are multiples of this (O_DIRECT's alignment)
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere buffered I/O only
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16  # buffers per call


@dataclass(frozen=True)
class StorageEntry:
    """One storage in an offload file."""

    names: tuple[str, ...]
    offset: int  # from the start of the data
    nbytes: int
    zeros: tuple[tuple[int, int], ...] = ()  # zero runs, storage-relative (version 2)


@dataclass(frozen=True)
class FileManifest:
    """What an offload file's header says (see [Note: file format])."""

    path: Path
    token: str  # unique per offload: a file of another offload is never taken for this one
    data_offset: int
    data_nbytes: int
    chunk_bytes: int
    chunk_crcs: tuple[int, ...]
    storages: tuple[StorageEntry, ...]

    @property
    def file_nbytes(self) -> int:
        return self.data_offset + self.data_nbytes

    def encode(self) -> bytes:
        """The header bytes (the writer pads them to ``data_offset``)."""
        body = json.dumps(
            {
                "token": self.token,
                "data_offset": self.data_offset,
                "data_nbytes": self.data_nbytes,
                "chunk_bytes": self.chunk_bytes,
                "chunk_crcs": [f"{c:08x}" for c in self.chunk_crcs],  # fixed width
                "storages": [
                    [list(s.names), s.offset, s.nbytes, [list(z) for z in s.zeros]]
                    for s in self.storages
                ],
            },
            separators=(",", ":"),
        ).encode()
        return _PREFIX.pack(MAGIC, VERSION, len(body), zlib.crc32(body)) + body


def read_manifest(path: Path) -> FileManifest:
    """Parse and check a file's header (not its data); `OffloadFileError` names what is wrong."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise OffloadFileError(path, "missing (deleted, or never completely written)") from None
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, _PREFIX.size, 0)
        if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
            raise OffloadFileError(path, "no zoffload header (not an offload file, or torn)")
        _, version, length, crc = _PREFIX.unpack(prefix)
        if version not in _READABLE:
            raise OffloadFileError(path, f"format version {version}, this zoffload reads {VERSION}")
        body = os.pread(fd, length, _PREFIX.size)
        COUNTERS.add(read=len(prefix) + len(body))
        if len(body) != length or zlib.crc32(body) != crc:
            raise OffloadFileError(path, "its header is corrupt (checksum mismatch)")
    finally:
        os.close(fd)
    meta = json.loads(body)
    manifest = FileManifest(
        path=path,
        token=meta["token"],
        data_offset=meta["data_offset"],
        data_nbytes=meta["data_nbytes"],
        chunk_bytes=meta["chunk_bytes"],
        chunk_crcs=tuple(int(c, 16) for c in meta["chunk_crcs"]),
        storages=tuple(_entry(row) for row in meta["storages"]),
    )
    if size != manifest.file_nbytes:
        what = "truncated" if size < manifest.file_nbytes else "longer than its header says"
        raise OffloadFileError(path, f"{what}: {size} bytes, expected {manifest.file_nbytes}")
    return manifest


def _entry(row: list[Any]) -> StorageEntry:
    names, offset, nbytes, *rest = row  # version 1 rows have no zero runs
    zeros = tuple((int(a), int(b)) for a, b in rest[0]) if rest else ()
    return StorageEntry(tuple(names), int(offset), int(nbytes), zeros)


def check_file(path: str | Path) -> FileManifest:
    """Check an offload file completely (header, size, every chunk's CRC) and return its header.

    Raises `OffloadFileError` naming the file and the problem.
    """
    manifest = read_manifest(Path(path))
    with open(manifest.path, "rb", buffering=0) as f:
        for i, (start, stop) in enumerate(_chunks(manifest.data_nbytes, manifest.chunk_bytes)):
            f.seek(manifest.data_offset + start)
            data = f.read(stop - start)
            if _crc32(data, 0) != manifest.chunk_crcs[i]:
                raise OffloadFileError(manifest.path, _bad_chunk(i, start, stop))
    return manifest


def _bad_chunk(i: int, start: int, stop: int) -> str:
    return f"chunk {i} (data bytes {start}..{stop}) fails its checksum: the file is corrupt"


def _chunks(nbytes: int, chunk: int) -> Iterator[tuple[int, int]]:
    for start in range(0, nbytes, chunk):
        yield start, min(start + chunk, nbytes)


def _pwrite_all(fd: int, data: list[memoryview], offset: int) -> None:
    """Write ``data`` (one buffer after the other) at ``offset`` (a write may be short)."""
    while data:
        n = os.pwritev(fd, data[:_IOV_MAX], offset)
        COUNTERS.add(written=n)  # [Note: NVMe accounting] in _stats
        data, offset = _advance(data, n), offset + n


def _pread_all(fd: int, into: list[memoryview], offset: int) -> int:
    """Fill ``into`` (one buffer after the other) from ``offset``; returns the bytes read
    (short only at end of file)."""
    done = 0
    while into:
        n = os.preadv(fd, into[:_IOV_MAX], offset + done)
        if n == 0:
            break
        COUNTERS.add(read=n)
        into, done = _advance(into, n), done + n
    return done


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """``buffers`` less their first ``n`` bytes."""
    i = 0
    while i < len(buffers) and n >= len(buffers[i]):
        n -= len(buffers[i])
        i += 1
    rest = buffers[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def _crc32_function() -> Callable[[memoryview | bytes, int], int]:
    """ISA-L's CRC-32 where the ``isal`` package is installed: the same checksum as zlib's,
    at about four times the speed (12 against 3 GB/s on one core here), and the reload's CRCs
    take a core for as long as the disk takes to read the bytes otherwise."""
    try:
        module = importlib.import_module("isal.isal_zlib")
    except ImportError:
        return zlib.crc32
    return cast(Callable[[memoryview | bytes, int], int], module.crc32)


_crc32 = _crc32_function()


def _crc(buffers: list[memoryview]) -> int:
    crc = 0
    for b in buffers:
        crc = _crc32(b, crc)
    return crc


@lru_cache(maxsize=8)
def _zeros_crc(nbytes: int) -> int:
    """The CRC-32 of a chunk of zeros (chunks that are holes: neither written nor read)."""
    return zlib.crc32(bytes(nbytes))


class NvmeIO:
    """Chunked, parallel, optionally direct file I/O for offload files.

    ``threads`` requests are in flight at once, each on its own ``chunk_bytes`` buffer from
    ``pool``. ``direct``: ``None`` tries O_DIRECT and falls back, ``True`` requires it,
    ``False`` never uses it.
    """

    def __init__(
        self, pool: HostPool, *, threads: int, chunk_bytes: int, direct: bool | None
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes % _BLOCK:
            raise ValueError(f"chunk_bytes must be a positive multiple of {_BLOCK}")
        if threads < 1:
            raise ValueError("threads must be at least 1")
        self.pool = pool
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.direct = direct
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._noted: set[Path] = set()  # directories whose O_DIRECT fallback was logged
        self._local = threading.local()  # per worker thread: its CUDA streams

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="zoffload-io")
            return self._executor

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        _deferred.wait()  # the files this offloader removed are freed

    def remove(self, path: Path) -> None:
        """Delete an offload file without waiting for its blocks to be freed.

        [Note: deferred free]
        The name goes at once, while this holds the file open: the blocks of an unlinked
        file are freed at its last close, and that close runs on a thread of its own, since
        on a filesystem mounted with ``discard`` freeing them waits for the device to trim
        every block (0.1 s per 512 MiB on ext4, measured: a tenth of a reload). The folder
        holds nothing more from then on (it may be deleted at once); a crash before the close
        leaves an orphan inode that the filesystem frees at its next mount. `close`,
        `wait_removals` and `free_bytes` (so every check of the room left; a write only
        where it finds too little) wait for the closes of the process's removed files.
        """
        fd = _open_if_there(path)
        if fd is None:
            return
        try:
            os.unlink(path)
        except BaseException as error:
            os.close(fd)
            if isinstance(error, FileNotFoundError):
                return  # deleted meanwhile
            raise
        self._close_later(fd)

    def _close_later(self, fd: int) -> None:
        """Close ``fd`` (of a file whose last name is gone) on the remover thread."""
        _deferred.close_later(fd)

    def wait_removals(self) -> None:
        """Wait until the files removed so far (by any offloader) have their blocks freed."""
        _deferred.wait()

    # -- writing ---------------------------------------------------------------------------

    def write(
        self,
        path: Path,
        slots: list[Slot],
        layout: Layout,
        *,
        pinned: bool,
        fences: dict[torch.device, torch.cuda.Event],
        durable: bool = True,
    ) -> tuple[FileManifest, bool]:
        """Write ``slots`` (laid out by ``layout``) to ``path``; returns its manifest and
        whether O_DIRECT was used. The file exists under ``path`` only once it is complete;
        ``durable=False``: without the fsyncs ([Note: scratch files])."""
        for slot in slots:
            slot.zeros = find_zero_runs(slot)
        draft = FileManifest(
            path=path,
            token=uuid.uuid4().hex,
            data_offset=0,
            data_nbytes=layout.nbytes,
            chunk_bytes=self.chunk_bytes,
            chunk_crcs=(0,) * len(range(0, layout.nbytes, self.chunk_bytes)),
            storages=tuple(
                StorageEntry(tuple(s.names), s.offset, s.nbytes, tuple(s.zeros)) for s in slots
            ),
        )
        # Checksums are fixed width, so only data_offset's digits can change the length.
        header_nbytes = align_up(len(draft.encode()) + 32, _BLOCK)
        needed = header_nbytes + _data_on_disk(slots, layout.nbytes, self.chunk_bytes)
        free = free_bytes_now(path.parent)
        if free is not None and needed > free:  # once the files removed so far are freed
            free = free_bytes(path.parent)
        if free is not None and needed > free:  # before a byte is written: nothing to undo
            raise NvmeSpaceError(path, "not enough free space", needed=needed, free=free)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{draft.token[:8]}")
        began = time.perf_counter()
        try:
            done = self._write(
                path, tmp, slots, layout, draft, header_nbytes, pinned, fences, durable
            )
        except OSError as error:  # a full disk, a read-only one, an I/O error: named
            raise nvme_error(path, error, needed=needed) from error
        COUNTERS.add(files_written=1, write_seconds=time.perf_counter() - began)
        return done

    def _write(
        self,
        path: Path,
        tmp: Path,
        slots: list[Slot],
        layout: Layout,
        draft: FileManifest,
        header_nbytes: int,
        pinned: bool,
        fences: dict[torch.device, torch.cuda.Event],
        durable: bool,
    ) -> tuple[FileManifest, bool]:
        fd, direct = self._open_for_write(tmp, header_nbytes)
        try:
            chunks = plan_chunks(slots, layout.nbytes, self.chunk_bytes, _alignment(fd, direct))
            used = [c for c in chunks if c.used]
            _preallocate(fd, header_nbytes, used)
            crcs = [_zeros_crc(c.stop - c.start) for c in chunks]  # holes: all zeros
            for chunk, crc in zip(
                used,
                self._run(tmp, fd, header_nbytes, used, pinned, fences, write=True),
                strict=True,
            ):
                crcs[chunk.index] = crc
            os.ftruncate(fd, header_nbytes + layout.nbytes)  # the holes at the end count too
            manifest = FileManifest(
                path, draft.token, header_nbytes, layout.nbytes, self.chunk_bytes,
                tuple(crcs), draft.storages,
            )  # fmt: skip
            header = manifest.encode()
            self._write_block(fd, header + bytes(header_nbytes - len(header)), 0)
            if durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        replaced = _open_if_there(path)  # a file this one replaces: freed later, see remove
        try:
            os.replace(tmp, path)  # atomic: the final name only ever names a complete file
        except BaseException:
            if replaced is not None:
                os.close(replaced)
            tmp.unlink(missing_ok=True)
            raise
        if replaced is not None:
            self._close_later(replaced)
        if durable:
            _fsync_dir(path.parent)
        return manifest, direct

    def _open_for_write(self, tmp: Path, header_nbytes: int) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self.direct is not False and _O_DIRECT:
            fd = -1
            try:
                fd = os.open(tmp, flags | _O_DIRECT, 0o600)
                # The zero header doubles as the probe: some filesystems accept the flag at
                # open and refuse the first write.
                self._write_block(fd, bytes(header_nbytes), 0)
                return fd, True
            except OSError as error:
                if fd >= 0:
                    os.close(fd)
                tmp.unlink(missing_ok=True)
                if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
                if self.direct:
                    raise OffloadError(f"O_DIRECT is not supported for {tmp}: {error}") from error
                self._note_fallback(tmp.parent, error)
        fd = os.open(tmp, flags, 0o600)
        self._write_block(fd, bytes(header_nbytes), 0)
        return fd, False

    def _note_fallback(self, directory: Path, error: OSError) -> None:
        with self._lock:
            if directory in self._noted:
                return
            self._noted.add(directory)
        _log.info("zoffload: no O_DIRECT under %s (%s); buffered I/O + fsync", directory, error)

    def _write_block(self, fd: int, data: bytes, offset: int) -> None:
        # O_DIRECT needs an aligned source address: copy through a page-aligned region.
        region = self.pool.allocate(len(data), pinned=False)
        try:
            view = region.memoryview(0, len(data))
            view[:] = data
            _pwrite_all(fd, [view], offset)
        finally:
            region.release()

    # -- reading ---------------------------------------------------------------------------

    def read(
        self,
        expected: FileManifest,
        slots: list[Slot],
        *,
        pinned: bool,
        fences: dict[torch.device, torch.cuda.Event],
    ) -> None:
        """Fill the (re-allocated) storages of ``slots`` from ``expected.path``, checking it."""
        began = time.perf_counter()
        found = read_manifest(expected.path)
        if found.token != expected.token:
            raise OffloadFileError(expected.path, "belongs to another offload (token mismatch)")
        if found != expected:
            raise OffloadFileError(expected.path, "its header differs from the one written")
        for slot, entry in zip(slots, expected.storages, strict=True):
            slot.zeros = list(entry.zeros)  # the file says which runs it holds as zeros
            view = byte_view(slot.storage, slot.nbytes)
            for start, stop in slot.zeros:
                release_pages(view[start:stop])
        fd, direct = self._open_for_read(expected.path)
        try:
            align = _alignment(fd, direct)
            chunks = plan_chunks(slots, expected.data_nbytes, expected.chunk_bytes, align)
            used = [c for c in chunks if c.used]  # the others hold only zeros nobody reads
            crcs = self._run(
                expected.path, fd, expected.data_offset, used, pinned, fences, write=False
            )
        finally:
            os.close(fd)
        for chunk, crc in zip(used, crcs, strict=True):
            if crc != expected.chunk_crcs[chunk.index]:
                raise OffloadFileError(
                    expected.path, _bad_chunk(chunk.index, chunk.start, chunk.stop)
                )
        COUNTERS.add(files_read=1, read_seconds=time.perf_counter() - began)

    def _open_for_read(self, path: Path) -> tuple[int, bool]:
        if self.direct is not False and _O_DIRECT:
            try:
                return os.open(path, os.O_RDONLY | _O_DIRECT), True
            except OSError as error:
                if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
        return os.open(path, os.O_RDONLY), False

    # -- the chunk pipeline ----------------------------------------------------------------

    def _run(
        self,
        path: Path,
        fd: int,
        base: int,
        chunks: list[Chunk],
        pinned: bool,
        fences: dict[torch.device, torch.cuda.Event],
        *,
        write: bool,
    ) -> list[int]:
        """Write or read ``chunks`` (the file's data starts at ``base``); their CRC-32s."""
        if not chunks:
            return []
        depth = min(self.threads, len(chunks))
        region = self.pool.allocate(depth * self.chunk_bytes, pinned=pinned)
        free: queue.SimpleQueue[int] = queue.SimpleQueue()  # offsets of idle chunk buffers
        for k in range(depth):
            free.put(k * self.chunk_bytes)
        task = self._write_chunk if write else self._read_chunk

        def one(chunk: Chunk) -> int:
            at = free.get()
            try:
                return task(path, fd, base, chunk, region, at, fences)
            finally:
                free.put(at)

        futures = []
        try:
            for chunk in chunks:
                futures.append(self._pool().submit(one, chunk))
            return [f.result() for f in futures]  # the first failure propagates
        finally:
            for f in futures:
                f.cancel()
            for f in futures:
                if not f.cancelled():
                    f.exception()  # wait: no task may still use the buffers we release
            region.release()

    def _write_chunk(
        self,
        path: Path,
        fd: int,
        base: int,
        chunk: Chunk,
        region: HostRegion,
        at: int,
        fences: dict[torch.device, torch.cuda.Event],
    ) -> int:
        buf = region.tensor[at : at + (chunk.stop - chunk.start)]
        copies = []
        for e in chunk.extents:
            if e.memory is not None:
                continue  # written from where it lies
            staged = buf[e.start - chunk.start : e.stop - chunk.start]
            if e.slot is None:
                staged.zero_()  # padding and zero runs: deterministic bytes
            else:
                copies.append((staged, _storage_bytes(e.slot, e.start, e.stop)))
        self._copy_all(copies, fences)
        buffers = _buffers(chunk, region, at)
        crc = _crc(buffers)
        _pwrite_all(fd, buffers, base + chunk.start)
        return crc

    def _read_chunk(
        self,
        path: Path,
        fd: int,
        base: int,
        chunk: Chunk,
        region: HostRegion,
        at: int,
        fences: dict[torch.device, torch.cuda.Event],
    ) -> int:
        buffers = _buffers(chunk, region, at)
        got = _pread_all(fd, buffers, base + chunk.start)
        if got != chunk.stop - chunk.start:
            raise OffloadFileError(path, "truncated while it was being read")
        crc = _crc(buffers)
        buf = region.tensor[at : at + (chunk.stop - chunk.start)]
        copies = []
        for e in chunk.extents:
            if e.slot is not None and e.memory is None:
                staged = buf[e.start - chunk.start : e.stop - chunk.start]
                copies.append((_storage_bytes(e.slot, e.start, e.stop), staged))
        self._copy_all(copies, fences)
        return crc

    def _copy_all(
        self,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        fences: dict[torch.device, torch.cuda.Event],
    ) -> None:
        """Do ``dst.copy_(src)`` for each pair; GPU copies on this thread's own stream."""
        used: set[torch.cuda.Stream] = set()
        for dst, src in copies:
            device = dst.device if dst.device.type == "cuda" else src.device
            if device.type != "cuda":
                dst.copy_(src)
                continue
            stream = self._thread_stream(device, fences.get(device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            used.add(stream)
        for stream in used:
            stream.synchronize()  # the chunk buffer is reused (or written out) next

    def _thread_stream(
        self, device: torch.device, fence: torch.cuda.Event | None
    ) -> torch.cuda.Stream:
        streams: dict[torch.device, torch.cuda.Stream] = self._local.__dict__.setdefault(
            "streams", {}
        )
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        if fence is not None:
            stream.wait_event(fence)  # the caller's writes (or allocations) come first
        return stream


def _buffers(chunk: Chunk, region: HostRegion, at: int) -> list[memoryview]:
    """The chunk's I/O buffers in file order: each direct extent's own memory, and for each
    run of other extents the matching bytes of the staging buffer at ``at`` in ``region``."""
    buffers = []
    staged_from: int | None = None  # start of the run of staged bytes being gathered
    for e in chunk.extents:
        if e.memory is None:
            staged_from = e.start if staged_from is None else staged_from
            continue
        if staged_from is not None:
            buffers.append(_staging(region, at, chunk, staged_from, e.start))
            staged_from = None
        buffers.append(e.memory)
    if staged_from is not None:
        buffers.append(_staging(region, at, chunk, staged_from, chunk.stop))
    return buffers


def _staging(region: HostRegion, at: int, chunk: Chunk, start: int, stop: int) -> memoryview:
    return region.memoryview(at + start - chunk.start, at + stop - chunk.start)


def _storage_bytes(slot: Slot, start: int, stop: int) -> torch.Tensor:
    """Bytes ``[start, stop)`` of the file's data that ``slot``'s storage holds, as its view."""
    return byte_view(slot.storage, slot.nbytes)[start - slot.offset : stop - slot.offset]


def _data_on_disk(slots: list[Slot], nbytes: int, chunk_bytes: int) -> int:
    """The data bytes a file of ``slots`` takes on disk: its chunks less those of zeros only
    (holes); checked against the free space before the file is written."""
    chunks = plan_chunks(slots, nbytes, chunk_bytes)
    return sum(c.stop - c.start for c in chunks if c.used)


def _fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).fallocate64  # glibc, Linux
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


_fallocate_call = _fallocate()


def _preallocate(fd: int, base: int, chunks: list[Chunk]) -> None:
    """Allocate the blocks that ``chunks`` will be written to (not the holes), up front.

    O_DIRECT writes into allocated blocks need neither allocation nor the inode's exclusive
    lock on ext4 and XFS, so the requests in flight really run at once (a write of 512 MiB
    took 0.87 of the time, measured), and a full disk fails before a byte is written. Only
    the filesystem's own ``fallocate``: where it has none, writes allocate as they go."""
    if _fallocate_call is None:
        return
    for start, stop in _spans(chunks):
        if _fallocate_call(fd, 0, base + start, stop - start) != 0:
            code = ctypes.get_errno()
            if code == errno.ENOSPC:
                raise OSError(code, os.strerror(code))
            return  # EOPNOTSUPP and the like: not worth a byte of emulation


def _spans(chunks: list[Chunk]) -> Iterator[tuple[int, int]]:
    """The data ranges that consecutive ``chunks`` cover."""
    start = stop = -1
    for chunk in chunks:
        if chunk.start != stop:
            if stop > start:
                yield start, stop
            start = chunk.start
        stop = chunk.stop
    if stop > start:
        yield start, stop


def _statx() -> Callable[[int, bytes, int, int, ctypes.Array[ctypes.c_char]], int] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).statx  # glibc 2.28
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    call.restype = ctypes.c_int
    return call


_statx_call = _statx()
_STATX_DIOALIGN, _AT_EMPTY_PATH = 0x2000, 0x1000
_STATX_MASK, _STATX_DIO = struct.Struct("<I"), struct.Struct("<II")  # at 0 and 152 (Linux 6.1)


def _alignment(fd: int, direct: bool) -> Alignment:
    """What the open file's I/O needs of a buffer (see [Note: extents] in ``_extents``): the
    kernel says for O_DIRECT (``statx``, Linux 6.1); a page where it cannot say."""
    if not direct:
        return Alignment(1, 1)
    buf = ctypes.create_string_buffer(256)
    if _statx_call is None or _statx_call(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return Alignment()
    (mask,) = _STATX_MASK.unpack_from(buf.raw, 0)
    memory, offset = _STATX_DIO.unpack_from(buf.raw, 152)
    if not mask & _STATX_DIOALIGN or not memory or not offset:
        return Alignment()
    return Alignment(memory, offset)


def _open_if_there(path: Path) -> int | None:
    """A read-only descriptor of ``path``, or None where there is no such file."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
