"""One pool of host memory, pinned where CUDA is present, reused across offload cycles.

[Note: exact-size pinning]
torch's pinned allocator rounds every block up to a power of two, so pinning 20.4 GiB holds
32 GiB, and ``Tensor.pin_memory()`` copies into a fresh block each call. The pool instead maps
anonymous memory of exactly the size asked (rounded to a page), asks for transparent huge
pages, registers it once with ``cudaHostRegister`` (pinning it), and carves page-aligned
regions out of it with a first-fit free list. Regions go back to the list when a reload is
done, blocks are only unpinned and unmapped by `HostPool.trim` or `HostPool.close`, so a
steady offload/reload cycle allocates and pins nothing after the first one
(`PoolStats.blocks_allocated` stays flat). Without CUDA the same blocks are plain memory.
Pages are page-aligned, which O_DIRECT file I/O needs too.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from zoffload import _cuda
from zoffload._layout import align_up

__all__ = ["HostPool", "HostRegion", "PoolStats", "default_pool"]

_HUGE_PAGE = 2 << 20


class Fence(Protocol):
    """Something that completes later, such as a ``torch.cuda.Event`` of a copy."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a `HostPool`."""

    blocks: int  # blocks held now
    reserved_bytes: int  # bytes held now, in use or not
    pinned_bytes: int  # of which page-locked for CUDA
    in_use_bytes: int  # handed out in regions not yet released
    blocks_allocated: int  # blocks ever mapped; flat across cycles means the pool is reused
    regions_allocated: int  # regions ever handed out


class _Block:
    """One mapping of host memory, optionally pinned, with its free byte ranges."""

    def __init__(self, nbytes: int, *, pinned: bool) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes)
        if nbytes >= _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # THP disabled: ordinary pages work too
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        if pinned:
            _cuda.register_host(self.tensor.data_ptr(), nbytes)
            self.pinned = True
        self.free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted, coalesced

    def take(self, nbytes: int) -> int | None:
        for i, (offset, size) in enumerate(self.free):
            if size >= nbytes:
                if size == nbytes:
                    del self.free[i]
                else:
                    self.free[i] = (offset + nbytes, size - nbytes)
                return offset
        return None

    def give(self, offset: int, nbytes: int) -> None:
        self.free.append((offset, nbytes))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for start, size in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self.free = merged

    @property
    def unused(self) -> bool:
        return self.free == [(0, self.nbytes)]

    def memoryview(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._map)[offset : offset + nbytes]

    def close(self) -> None:
        if self.pinned:
            _cuda.unregister_host(self.tensor.data_ptr())
            self.pinned = False
        del self.tensor
        with contextlib.suppress(BufferError):  # a view still lives: the map goes with it
            self._map.close()


class HostRegion:
    """Page-aligned host bytes lent by a `HostPool` until `release`."""

    def __init__(self, pool: HostPool, block: _Block, offset: int, nbytes: int) -> None:
        self._pool = pool
        self._block: _Block | None = block
        self.offset = offset
        self.nbytes = nbytes
        self.pinned = block.pinned
        self.tensor = block.tensor[offset : offset + nbytes]  # flat uint8 view

    def memoryview(self, start: int = 0, stop: int | None = None) -> memoryview:
        """The region's bytes (or ``[start, stop)`` of them) as a writable memoryview."""
        if self._block is None:
            raise ValueError("the region was released")
        stop = self.nbytes if stop is None else stop
        return self._block.memoryview(self.offset + start, stop - start)

    def release(self, fence: Fence | None = None) -> None:
        """Give the bytes back; reuse waits for ``fence`` (a copy still reading them)."""
        block, self._block = self._block, None
        if block is not None:
            self.tensor = block.tensor[:0]
            self._pool._give(block, self.offset, self.nbytes, fence)


class HostPool:
    """Host memory for offloaded bytes and I/O buffers, reused across cycles.

    ``alignment`` is the granularity of regions (a page: what O_DIRECT and DMA want). The
    pool is thread-safe. See [Note: exact-size pinning].
    """

    def __init__(self, *, alignment: int = 4096) -> None:
        self.alignment = alignment
        self._lock = threading.Lock()
        self._blocks: list[_Block] = []
        self._pending: list[tuple[_Block, int, int, Fence]] = []  # deferred gives
        self._blocks_allocated = 0
        self._regions_allocated = 0

    def allocate(self, nbytes: int, *, pinned: bool) -> HostRegion:
        """A region of at least ``nbytes`` (rounded to the alignment).

        ``pinned=True`` asks for page-locked memory; without a CUDA device it silently
        means ordinary memory (``region.pinned`` says which it got).
        """
        pinned = pinned and _cuda.cuda_available()
        size = max(align_up(nbytes, self.alignment), self.alignment)
        with self._lock:
            self._collect(block=False)
            found = self._take(size, pinned)
            if found is None and self._pending:
                self._collect(block=True)  # wait for in-flight copies rather than grow
                found = self._take(size, pinned)
            if found is None:
                block = _Block(size, pinned=pinned)
                self._blocks.append(block)
                self._blocks_allocated += 1
                offset = block.take(size)
                assert offset == 0
                found = (block, offset)
            self._regions_allocated += 1
        return HostRegion(self, found[0], found[1], size)

    def _take(self, size: int, pinned: bool) -> tuple[_Block, int] | None:
        for block in self._blocks:
            if block.pinned == pinned:
                offset = block.take(size)
                if offset is not None:
                    return block, offset
        return None

    def _give(self, block: _Block, offset: int, nbytes: int, fence: Fence | None) -> None:
        with self._lock:
            if fence is None or fence.query():
                block.give(offset, nbytes)
            else:
                self._pending.append((block, offset, nbytes, fence))

    def _collect(self, *, block: bool) -> None:
        still: list[tuple[_Block, int, int, Fence]] = []
        for item in self._pending:
            owner, offset, nbytes, fence = item
            if block:
                fence.synchronize()
            if fence.query():
                owner.give(offset, nbytes)
            else:
                still.append(item)
        self._pending = still

    def stats(self) -> PoolStats:
        """Counts and bytes of the pool now."""
        with self._lock:
            self._collect(block=False)
            reserved = sum(b.nbytes for b in self._blocks)
            free = sum(size for b in self._blocks for _, size in b.free)
            return PoolStats(
                blocks=len(self._blocks),
                reserved_bytes=reserved,
                pinned_bytes=sum(b.nbytes for b in self._blocks if b.pinned),
                in_use_bytes=reserved - free,
                blocks_allocated=self._blocks_allocated,
                regions_allocated=self._regions_allocated,
            )

    def trim(self, *, pinned: bool | None = None) -> int:
        """Unpin and unmap every block with nothing in use (only the pinned or only the
        unpinned ones with `pinned`); returns the bytes given back."""
        with self._lock:
            self._collect(block=False)
            unused = [
                b for b in self._blocks if b.unused and (pinned is None or b.pinned == pinned)
            ]
            self._blocks = [b for b in self._blocks if b not in unused]
        for block in unused:
            block.close()
        return sum(b.nbytes for b in unused)

    def close(self) -> None:
        """Free every block; regions still lent out make this an error."""
        with self._lock:
            self._collect(block=True)
            busy = [b for b in self._blocks if not b.unused]
        if busy:
            raise RuntimeError(f"HostPool.close: {len(busy)} block(s) still hold live regions")
        self.trim()


_default: HostPool | None = None
_default_lock = threading.Lock()


def default_pool() -> HostPool:
    """The process-wide pool that `zoffload.offload` uses."""
    global _default
    with _default_lock:
        if _default is None:
            _default = HostPool()
        return _default
