"""The gradient partition on NVMe between the backward that ends an accumulation and the step.

[Note: gradients beyond memory]
With ``offload_optimizer: {device: nvme}`` and a step in tiles (``sub_group_size``), the
masters and the optimizer state are in memory a few tiles at a time; the gradient partition
would still be whole (2 bytes a parameter in bf16: 4.6 GB at 2.3 B parameters). So during the
backward that ends an accumulation, each tile's slice of the partition is written to a file of
its own as soon as its last gradient has arrived (backward runs the model in reverse, so the
last tile is complete first), its squared norm taken on the way in float64 (the step's global
norm is their sum, the same in a float as one sum over the buffer), and its pages handed back;
the step reads each tile's gradients back beside its state, one tile ahead, and hands the
pages back once the tile is stepped. A tile is complete when its parameters outside the
persistent unit have their gradients (the persistent unit's, small parameters of every layer,
are reduced at the end of the backward): the persistent ones' are set aside then, added to
aside, and put back when the tile is read. What the process holds of the gradients is then a few
tiles, as of the rest of the state. The backward passes before the boundary accumulate in
memory as before (their sums are not final).

The slices are views of DeepSpeed's flat ``grad_partitions_flat_buffer``, not storages of
their own, so zoffload (which empties storages) does not move them: the bytes go through
plain ``pwrite``/``pread`` on a thread of this class's, the file's pages dropped from the page
cache once on disk (``fdatasync``, ``POSIX_FADV_DONTNEED``), and the slice's whole pages
handed back with ``MADV_DONTNEED`` (`release_pages`; its edge pages, shared with the next
tile, are zeroed in place).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from zoffload import release_pages

__all__ = ["WRITES_IN_FLIGHT", "GradientSwap"]

WRITES_IN_FLIGHT = 2
"""Tiles written at once; one more makes a backward wait for the oldest: beside the tile
being filled, the gradients held in memory are this many tiles."""


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The host memory under contiguous `tensor`, as a writable byte view."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _drop_cache(fd: int) -> None:
    with contextlib.suppress(AttributeError, OSError):  # advice only
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class GradientSwap:
    """Per tile, a contiguous slice of the gradient partition, written to its file and
    released between the boundary's backward and the step ([Note: gradients beyond memory])."""

    def __init__(self, folder: Path, slices: list[torch.Tensor]) -> None:
        for s in slices:
            if s.device.type != "cpu" or not s.is_contiguous():  # pwrite reads the host's memory
                raise ValueError("GradientSwap: the gradient slices must be contiguous, on the CPU")
        self.slices = slices
        self.paths = [Path(folder) / f"grads-tile{k}.bin" for k in range(len(slices))]
        self._io = ThreadPoolExecutor(1, thread_name_prefix="zengine-grads")
        self._moves: list[Future[None] | None] = [None] * len(slices)  # write or read in flight
        self.away = [False] * len(slices)  # on disk, pages released (or on the way)
        self._norm_sq: list[torch.Tensor | None] = [None] * len(slices)
        self._writing: list[int] = []  # tiles being written, oldest first
        self._late: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # key: tile, view, aside
        self.bytes_written = 0
        self.bytes_read = 0

    def put_away(self, k: int, late: dict[int, torch.Tensor] | None = None) -> None:
        """Tile `k`'s gradients are final: note their squared norm and write them out in the
        background, its pages handed back once written. `late`: views of the slice (by a key
        of the caller's) whose gradients come after the tile's others (a persistent unit's,
        reduced at the end of the backward): set aside, added to where `late_target` says,
        and put back into the slice when it is read back."""
        if self.away[k]:
            return
        self._settle(k)
        for key, view in (late or {}).items():
            self._late[key] = (k, view, view.clone())
            view.zero_()
        self._norm_sq[k] = torch.linalg.vector_norm(self.slices[k], dtype=torch.float64).square()
        self.away[k] = True
        self._moves[k] = self._io.submit(self._write, k)
        self._writing.append(k)
        while len(self._writing) > WRITES_IN_FLIGHT:  # the backward waits: a few tiles held
            self._settle(self._writing.pop(0))

    def _write(self, k: int) -> None:
        data = self.slices[k]
        view = _bytes(data)
        fd = os.open(self.paths[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
            os.fdatasync(fd)
            _drop_cache(fd)
        finally:
            os.close(fd)
        self.bytes_written += len(view)
        release_pages(data)

    def _read(self, k: int) -> None:
        view = _bytes(self.slices[k])
        fd = os.open(self.paths[k], os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], done)
                if got <= 0:
                    raise OSError(f"{self.paths[k]}: short read ({done} of {len(view)} bytes)")
                done += got
            _drop_cache(fd)
        finally:
            os.close(fd)
        self.bytes_read += len(view)

    def late_target(self, key: int) -> torch.Tensor | None:
        """Where a late gradient (`put_away`'s `late`) adds while its tile is away."""
        found = self._late.get(key)
        return None if found is None or not self.away[found[0]] else found[2]

    def _put_back_late(self, k: int) -> None:
        for key, (tile, view, aside) in list(self._late.items()):
            if tile == k:
                view.copy_(aside)
                del self._late[key]

    def _settle(self, k: int) -> None:
        if k in self._writing:
            self._writing.remove(k)
        move, self._moves[k] = self._moves[k], None
        if move is not None:
            move.result()

    def prefetch(self, k: int) -> None:
        """Start reading tile `k` back (nothing when it is in memory or there is none)."""
        if k >= len(self.slices) or not self.away[k]:
            return
        self._settle(k)  # its write first
        self.away[k] = False
        self._moves[k] = self._io.submit(self._read, k)

    def fetch(self, k: int) -> None:
        """Tile `k`'s gradients in memory when this returns."""
        self.prefetch(k)
        self._settle(k)
        self._put_back_late(k)

    def fetch_all(self) -> None:
        for k in range(len(self.slices)):
            self.prefetch(k)
        for k in range(len(self.slices)):
            self._settle(k)
            self._put_back_late(k)

    def release(self, k: int) -> None:
        """Tile `k` was stepped: zero its gradients, handing its pages back."""
        self._settle(k)
        release_pages(self.slices[k])
        self._norm_sq[k] = None

    def forget(self) -> None:
        """The gradients were zeroed (after a step, or dropped): nothing is away any more."""
        for k in range(len(self.slices)):
            self._settle(k)
        self.away = [False] * len(self.slices)
        self._norm_sq = [None] * len(self.slices)
        self._late.clear()

    @property
    def any_away(self) -> bool:
        return any(self.away) or any(n is not None for n in self._norm_sq)

    def norm_sq(self) -> torch.Tensor:
        """This rank's squared gradient norm: the tiles written out from the norms noted,
        the others from memory."""
        total = torch.zeros((), dtype=torch.float64)
        for k, s in enumerate(self.slices):
            noted = self._norm_sq[k]
            if noted is None:
                noted = torch.linalg.vector_norm(s, dtype=torch.float64).square()
            total += noted
        for tile, _, aside in self._late.values():
            if self.away[tile]:
                total += torch.linalg.vector_norm(aside, dtype=torch.float64).square()
        return total

    def close(self) -> None:
        """Wait for the transfers in flight and remove the files."""
        with contextlib.suppress(Exception):
            for k in range(len(self.slices)):
                self._settle(k)
        self._io.shutdown(wait=True)
        for path in self.paths:
            path.unlink(missing_ok=True)
