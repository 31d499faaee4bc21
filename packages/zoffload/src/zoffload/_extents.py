"""Which bytes of an offload file's chunks go where: in place, through a staging buffer, or
nowhere.

[Note: extents]
An offload file's data is read and written in chunks of ``chunk_bytes``, each with its CRC-32,
and every chunk is cut, in file order, into extents of three kinds:

- direct: a host storage's own memory is the I/O buffer, no copy. O_DIRECT wants each
  buffer's address aligned to the device's memory alignment and its file offset and size to
  the offset alignment (an `Alignment`, from ``statx``): a storage qualifies when its address
  and its layout offset are equal modulo the memory alignment (always, where that is a few
  bytes, as NVMe drives usually report; by [Note: direct placement] in ``_layout`` where it
  is 512 or a page), and then its interior from the first to the last aligned byte moves in
  place, in pieces of at least ``_MIN_DIRECT`` bytes. Buffered I/O has no such rules;
- staged: bytes of a storage, copied between it and the chunk's page-aligned staging buffer
  (pinned where a GPU is involved), at the same place in the buffer as in the chunk: GPU
  storages, small ones, the unaligned head and tail of large host ones, and host storages
  whose address at reload does not line up;
- unused: the padding between storages and the zero runs of host storages (see
  [Note: zero pages] in ``_pages``). They are written as zeros and never copied into a
  storage: a reload hands a zero run's pages back instead (`_pages.release`).

One request moves a whole chunk (``preadv``/``pwritev`` over its buffers in file order) and
its CRC-32 is computed over the same buffers in the same order, wherever they lie. A chunk
holding only unused bytes is all zeros: it is neither written (the file has a hole there,
which reads as zeros, so `check_file` still finds its CRC) nor read back.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from zoffload._pages import ZERO_BLOCK, zero_runs
from zoffload._storage import Slot, byte_view, host_memoryview

__all__ = ["BLOCK", "Alignment", "Chunk", "Extent", "find_zero_runs", "plan_chunks"]

BLOCK = 4096  # chunks, staging buffers and the data start on these (O_DIRECT's largest need)
# Smaller aligned pieces are staged: it bounds a chunk's buffers to chunk_bytes / 64 KiB or
# so, and the copy it saves is cheaper than the extra buffer of the request.
_MIN_DIRECT = 64 << 10

_PEEK_BLOCKS = 64  # up to this many blocks, peek at them from Python (no torch call per block)
_WINDOW_BLOCKS = 128  # blocks that one zero_runs call checks whole (8 MiB)


@dataclass(frozen=True)
class Alignment:
    """What a file's I/O needs of a buffer moved in place: its address a multiple of
    ``memory``, its file offset and size multiples of ``offset`` (1, 1: buffered I/O)."""

    memory: int = BLOCK
    offset: int = BLOCK


@dataclass(frozen=True)
class Extent:
    """Bytes ``[start, stop)`` of the file's data, all of one kind."""

    start: int
    stop: int
    slot: Slot | None  # the storage the bytes belong to; None: padding or a zero run
    memory: memoryview | None = None  # direct: the storage's own bytes, the I/O buffer


@dataclass(frozen=True)
class Chunk:
    """One request and one CRC-32: bytes ``[start, stop)`` of the data, cut into extents."""

    index: int
    start: int
    stop: int
    extents: tuple[Extent, ...]

    @property
    def used(self) -> bool:
        """Whether any byte of the chunk goes to or comes from a storage."""
        return any(e.slot is not None for e in self.extents)


def plan_chunks(
    slots: list[Slot], nbytes: int, chunk_bytes: int, align: Alignment | None = None
) -> list[Chunk]:
    """The chunks of ``nbytes`` of data laid out as ``slots`` say, with their extents; with
    ``align`` (the file's needs), host storages that can move in place do."""
    extents = list(_all_extents(slots, nbytes, align))
    chunks = []
    i = 0
    for index, start in enumerate(range(0, nbytes, chunk_bytes)):
        stop = min(start + chunk_bytes, nbytes)
        mine = []
        while i < len(extents) and extents[i].start < stop:
            e = extents[i]
            mine.append(_cut(e, max(e.start, start), min(e.stop, stop)))
            if e.stop > stop:
                break  # it goes on in the next chunk
            i += 1
        chunks.append(Chunk(index, start, stop, tuple(mine)))
    return chunks


def _cut(e: Extent, start: int, stop: int) -> Extent:
    memory = None if e.memory is None else e.memory[start - e.start : stop - e.start]
    return Extent(start, stop, e.slot, memory)


def _all_extents(slots: list[Slot], nbytes: int, align: Alignment | None) -> Iterator[Extent]:
    cursor = 0
    for slot in sorted((s for s in slots if s.nbytes), key=lambda s: s.offset):
        if slot.offset > cursor:
            yield Extent(cursor, slot.offset, None)
        yield from _slot_extents(slot, align)
        cursor = slot.offset + slot.nbytes
    if cursor < nbytes:
        yield Extent(cursor, nbytes, None)


def _slot_extents(slot: Slot, align: Alignment | None) -> Iterator[Extent]:
    memory = _direct_memory(slot, align)
    cursor = 0
    for start, stop in slot.zeros:
        if start > cursor:
            yield from _used(slot, cursor, start, memory)
        yield Extent(slot.offset + start, slot.offset + stop, None)
        cursor = stop
    if cursor < slot.nbytes:
        yield from _used(slot, cursor, slot.nbytes, memory)


@dataclass(frozen=True)
class _InPlace:
    """A storage that moves in place: its bytes, and the step its direct pieces keep to."""

    bytes: memoryview
    step: int


def _direct_memory(slot: Slot, align: Alignment | None) -> _InPlace | None:
    """How the storage's interior moves in place, or None where it cannot."""
    if align is None or slot.device.type != "cpu" or slot.nbytes < _MIN_DIRECT:
        return None
    if BLOCK % max(align.memory, align.offset):
        return None  # stricter than the staging buffers' pages (or odd): nothing in place
    if (slot.storage.data_ptr() - slot.offset) % align.memory:
        return None  # allocated elsewhere in its page than at offload: staged
    # A piece starting and ending on multiples of the larger alignment in the file starts on
    # one of the memory alignment too, since address and offset agree modulo the latter.
    step = max(align.memory, align.offset)
    return _InPlace(host_memoryview(byte_view(slot.storage, slot.nbytes)), step)


def _used(slot: Slot, start: int, stop: int, place: _InPlace | None) -> Iterator[Extent]:
    """Extents for the storage's bytes ``[start, stop)``: the aligned interior in place."""
    base = slot.offset
    if place is not None:
        step = place.step
        lo = -(-(base + start) // step) * step - base
        hi = (base + stop) // step * step - base
        if hi - lo >= _MIN_DIRECT:
            if lo > start:
                yield Extent(base + start, base + lo, slot)
            yield Extent(base + lo, base + hi, slot, place.bytes[lo:hi])
            if stop > hi:
                yield Extent(base + hi, base + stop, slot)
            return
    yield Extent(base + start, base + stop, slot)


def find_zero_runs(slot: Slot) -> list[tuple[int, int]]:
    """`_pages.zero_runs` of a host storage (storage-relative), cheaply: blocks whose first
    word is not zero are passed over, so only blocks that may be zeros are read whole.
    Reading pages that were handed back maps the shared zero page: nothing becomes resident."""
    if slot.device.type != "cpu" or slot.nbytes < ZERO_BLOCK:
        return []
    whole = slot.nbytes // ZERO_BLOCK
    address = slot.storage.data_ptr()
    if address % 8:  # not torch's allocation (it aligns to 64): no word reads, every block
        maybe = list(range(whole))
    elif whole <= _PEEK_BLOCKS:  # most storages: a few reads from Python, no tensor at all
        peek = ctypes.c_uint64.from_address
        maybe = [k for k in range(whole) if peek(address + k * ZERO_BLOCK).value == 0]
    else:
        heads = byte_view(slot.storage, whole * ZERO_BLOCK).view(whole, ZERO_BLOCK)[:, :8]
        maybe = heads.view(torch.int64).flatten().eq(0).nonzero().flatten().tolist()
    if not maybe:
        return []
    data = byte_view(slot.storage, slot.nbytes)
    runs: list[tuple[int, int]] = []
    for first, last in _spans(maybe):
        # In windows: zero_runs' temporaries are an eighth of what it looks at, and a window
        # of zeros handed back costs no memory to read, but its temporaries do.
        for lo in range(first, last, _WINDOW_BLOCKS):
            at = lo * ZERO_BLOCK
            window = data[at : min(last, lo + _WINDOW_BLOCKS) * ZERO_BLOCK]
            for a, b in zero_runs(window):
                if runs and runs[-1][1] == at + a:  # goes on from the previous window
                    runs[-1] = (runs[-1][0], at + b)
                else:
                    runs.append((at + a, at + b))
    return runs


def _spans(ks: list[int]) -> Iterator[tuple[int, int]]:
    """Runs of consecutive integers in sorted ``ks``, as ``[first, last)``."""
    i = 0
    while i < len(ks):
        j = i
        while j + 1 < len(ks) and ks[j + 1] == ks[j] + 1:
            j += 1
        yield ks[i], ks[j] + 1
        i = j + 1
