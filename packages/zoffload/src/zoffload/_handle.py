"""The handle of one offload: where the bytes went, how to wait, how to bring them back.

A handle moves through ``offloading -> offloaded -> reloading -> resident``. ``wait()``
finishes whatever transfer is in flight (and re-raises its error); ``reload()`` first waits
for the offload. Transfers that finish asynchronously:

- GPU to pinned host (``device=cpu``, ``non_blocking=True``): the copies run on zoffload's
  stream; the device memory is handed back to torch's caching allocator at once, safely
  (see [Note: stream order] in ``_cuda``), and the host copy is valid after ``wait()``.
- GPU from pinned host (``reload(non_blocking=True)``): the caller's stream waits for the
  copy on the device, so kernels queued after ``reload`` see the data; the host need not
  wait. ``wait()`` also runs the ``verify`` check.
- NVMe, either way (``non_blocking=True``): a background thread does the file I/O; storages
  are freed once the file is durable (a failed write leaves the tensors untouched) and are
  filled before ``wait()`` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zoffload import _cuda, _registry
from zoffload._enums import OffloadDeviceEnum
from zoffload._errors import OffloadChecksumError, OffloadError
from zoffload._layout import Layout, Segment
from zoffload._nvme import FileManifest
from zoffload._pool import HostRegion
from zoffload._storage import Slot, byte_view, fingerprint, storage_key

if TYPE_CHECKING:
    from zoffload._offloader import Offloader

__all__ = ["OffloadHandle"]


class OffloadHandle:
    """The bytes of some named tensors, moved off their device by `zoffload.offload`.

    The tensors stay the same objects with the same storages, emptied (``nbytes() == 0``)
    until `reload` fills them again, bit-exact. Read none of them in between.
    """

    def __init__(
        self,
        offloader: Offloader,
        tensors: dict[str, torch.Tensor],
        slots: list[Slot],
        layout: Layout,
        device: OffloadDeviceEnum,
        *,
        pinned: bool,
        verify: bool,
        durable: bool = True,
    ) -> None:
        self._offloader = offloader  # its pool, NVMe I/O threads and background driver
        self._tensors = tensors  # what the caller named, kept alive while the bytes are away
        self._slots = slots  # the distinct storages, with their layout offsets
        self._layout = layout
        self._device = device
        self._pinned = pinned
        self._verify = verify
        self._durable = durable  # NVMe: fsync'd files, or scratch ([Note: scratch files])
        self._keys = [storage_key(s.tensors[0]) for s in slots]
        self._state = "offloading"
        self._region: HostRegion | None = None  # device=cpu: where the bytes are
        self._manifest: FileManifest | None = None  # device=nvme: the file that holds them
        self._file: Path | None = None  # device=nvme: where the file goes, at every offload
        self._direct_io: bool | None = None
        # The transfer in flight: a background job and/or CUDA events, then `_finish` once.
        self._future: Future[None] | None = None
        self._events: list[torch.cuda.Event] = []
        self._finish: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._hold = False  # commit=False: the file is written, the bytes stay until commit

    def __repr__(self) -> str:
        return (
            f"OffloadHandle({len(self._tensors)} tensors, {self.nbytes} bytes, "
            f"device={self._device.value}, {self._state})"
        )

    # -- what the handle holds --------------------------------------------------------------

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by the names given to `offload` (a copy of the mapping)."""
        return dict(self._tensors)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    @property
    def device(self) -> OffloadDeviceEnum:
        """Where the bytes go while offloaded: ``cpu``, ``nvme``, or ``none`` (not kept)."""
        return self._device

    @property
    def devices(self) -> frozenset[torch.device]:
        """The devices the tensors live on, and come back to on reload."""
        return frozenset(s.device for s in self._slots)

    @property
    def nbytes(self) -> int:
        """Bytes moved: the sum over the distinct storages (shared storage counts once)."""
        return sum(s.nbytes for s in self._slots)

    @property
    def pinned(self) -> bool:
        """Whether the host bytes (or the NVMe I/O buffers) are page-locked."""
        return self._pinned

    @property
    def path(self) -> Path | None:
        """The NVMe file holding the bytes (``device=nvme``: while offloaded, or kept by
        ``reload(keep=True)``)."""
        return None if self._manifest is None else self._manifest.path

    @property
    def direct_io(self) -> bool | None:
        """Whether the NVMe file was written with O_DIRECT (``None`` for other devices)."""
        return self._direct_io

    @property
    def state(self) -> str:
        """``offloading``, ``offloaded``, ``reloading`` or ``resident``; ``written`` for an
        offload with ``commit=False`` whose file is complete and whose bytes are still here."""
        return self._state

    @property
    def offloaded(self) -> bool:
        """Whether the tensors are empty now (their bytes away or on their way)."""
        return self._state in ("offloading", "offloaded")

    # -- waiting --------------------------------------------------------------------------

    def done(self) -> bool:
        """Whether the transfer in flight has finished (never blocks)."""
        future_done = self._future is None or self._future.done()
        return future_done and all(e.query() for e in self._events)  # type: ignore[no-untyped-call]

    def wait(self) -> OffloadHandle:
        """Block until the transfer in flight is complete; re-raises its error. Idempotent."""
        with self._lock:
            future, self._future = self._future, None
            events, self._events = self._events, []
            finish, self._finish = self._finish, None
            try:
                if future is not None:
                    future.result()
                for event in events:
                    event.synchronize()
            except BaseException:
                self._failed()
                raise
            if finish is not None:
                finish()
        return self

    def _failed(self) -> None:
        """Undo the state change of a transfer that raised."""
        if self._state == "offloading":  # nothing was freed: the tensors are as they were
            _registry.remove(self._keys, self)
            self._state = "resident"
        elif self._state == "reloading":  # half-filled storages are emptied again
            self._future, self._events, self._finish = None, [], None
            self._free()
            self._state = "offloaded"

    def _start(
        self,
        *,
        future: Future[None] | None = None,
        events: list[torch.cuda.Event] | None = None,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._future, self._events, self._finish = future, events or [], finish

    # -- offload --------------------------------------------------------------------------

    def _offload(self, *, non_blocking: bool, nvme_file: Path | None) -> None:
        """Start an offload (the offloader's first, or `offload` again)."""
        _registry.add(self._keys, self)
        try:
            if self._verify:
                for slot in self._slots:
                    slot.fingerprint = fingerprint(byte_view(slot.storage))
            if self._device == OffloadDeviceEnum.nvme:
                self._file = nvme_file or self._file
                assert self._file is not None
                self._offload_nvme(self._file, non_blocking=non_blocking)
            elif self._device == OffloadDeviceEnum.cpu:
                self._offload_host(non_blocking=non_blocking)
            else:
                self._free()
                self._state = "offloaded"
        except BaseException:
            self._failed()
            raise

    def _offload_host(self, *, non_blocking: bool) -> None:
        region = self._offloader.pool.allocate(self._layout.nbytes, pinned=self._pinned)
        try:
            events = self._to_host(region.tensor)
        except BaseException:
            region.release()
            raise
        self._region = region
        self._free()
        self._start(events=events, finish=self._offloaded)
        if not non_blocking:
            self.wait()

    def _offloaded(self) -> None:
        self._state = "offloaded"

    def _to_host(self, host: torch.Tensor) -> list[torch.cuda.Event]:
        events = []
        for device, segments in _by_device(self._layout.segments).items():
            if device.type == "cuda":
                events.append(_cuda.copier(device).to_host(segments, host))
                continue
            for seg in segments:
                for slot in seg.slots:
                    host[slot.offset : slot.offset + slot.nbytes].copy_(byte_view(slot.storage))
        return events

    def _offload_nvme(self, path: Path, *, non_blocking: bool) -> None:
        fences = _fences(self.devices)
        io = self._offloader.io

        hold, durable = self._hold, self._durable

        def job() -> None:
            manifest, direct = io.write(
                path,
                self._slots,
                self._layout,
                pinned=self._pinned,
                fences=fences,
                durable=durable,
            )
            self._manifest, self._direct_io = manifest, direct
            if not hold:
                self._free()  # only now: a failed write leaves every tensor as it was

        done = self._written if hold else self._offloaded
        if non_blocking:
            self._start(future=self._offloader.background(job), finish=done)
        else:
            job()  # an error propagates to `_offload`, which undoes the state
            done()

    def _written(self) -> None:
        self._state = "written"

    def commit(self) -> OffloadHandle:
        """Empty the tensors of an offload made with ``commit=False`` (its file is written):
        the move completes. Waits for the write first (and raises its error)."""
        self.wait()
        if self._state != "written":
            raise OffloadError(f"commit: the handle is {self._state}, not written ({self!r})")
        self._hold = False
        self._free()
        self._state = "offloaded"
        return self

    def abandon(self) -> None:
        """Undo an offload made with ``commit=False``: its file goes, the tensors keep their
        bytes (never emptied) and are free to be offloaded again. A write that failed is
        already undone (its error was raised by `wait`); this does nothing then."""
        try:
            self.wait()
        except Exception:  # the write's own error, raised already: nothing to undo
            return
        if self._state != "written":
            raise OffloadError(f"abandon: the handle is {self._state}, not written ({self!r})")
        self._hold = False
        self._drop_copy()
        _registry.remove(self._keys, self)
        self._state = "resident"

    def _free(self) -> None:
        for slot in self._slots:
            slot.storage.resize_(0)

    def _restore(self) -> None:
        for slot in self._slots:
            slot.storage.resize_(slot.nbytes)

    # -- reload ---------------------------------------------------------------------------

    def reload(self, *, non_blocking: bool = False, keep: bool = False) -> OffloadHandle:
        """Refill the same storages with the offloaded bytes and give the host memory back.

        With ``non_blocking=True`` the copies may still run when this returns (see the module
        docstring); call `wait` before reading the tensors on the host. Errors of a file that
        is missing, truncated or corrupt name the file (`OffloadFileError`), and leave the
        handle offloaded so nothing half-filled is mistaken for good data.

        ``keep=True`` keeps the copy (host memory or file) after the bytes are back, so that
        `offload` with ``rewrite=False`` can empty the tensors again without moving a byte
        (for state swapped in and out often and changed seldom, as parameter shards are).
        """
        self.wait()  # an offload still in flight completes first (and raises if it failed)
        if self._state != "offloaded":
            raise OffloadError(f"reload: the handle is {self._state}, not offloaded ({self!r})")
        self._restore()
        self._state = "reloading"
        try:
            if self._device == OffloadDeviceEnum.cpu:
                self._reload_host(keep)
            elif self._device == OffloadDeviceEnum.nvme:
                self._reload_nvme(non_blocking=non_blocking, keep=keep)
            else:
                self._start(finish=self._resident)
        except BaseException:
            self._failed()
            raise
        if not non_blocking:
            self.wait()
        return self

    def _reload_host(self, keep: bool) -> None:
        region = self._region
        assert region is not None
        events = []
        for device, segments in _by_device(self._layout.segments).items():
            if device.type == "cuda":
                events.append(_cuda.copier(device).to_device(segments, region.tensor))
                continue
            for seg in segments:
                for slot in seg.slots:
                    src = region.tensor[slot.offset : slot.offset + slot.nbytes]
                    byte_view(slot.storage).copy_(src)
        if not keep:  # the pool may lend the region again once the copies have read it
            self._region = None
            region.release(_AllOf(events) if events else None)
        self._start(events=events, finish=self._resident)

    def _reload_nvme(self, *, non_blocking: bool, keep: bool) -> None:
        manifest = self._manifest
        assert manifest is not None
        fences = _fences(self.devices)
        io = self._offloader.io

        def job() -> None:
            io.read(manifest, self._slots, pinned=self._pinned, fences=fences)

        def finish() -> None:
            if not keep:
                self._drop_copy()
            self._resident()

        if not non_blocking:
            job()
            self._start(finish=finish)
            return
        self._start(future=self._offloader.background(job), finish=finish)

    def offload(self, *, rewrite: bool = True, non_blocking: bool = False) -> OffloadHandle:
        """Empty the same tensors again after a `reload` (the same names, the same file).

        ``rewrite=False`` with a copy kept by ``reload(keep=True)`` only frees the storages:
        the caller vouches that no byte changed since the reload (a ``verify`` handle checks
        it). Otherwise the bytes move as at the first offload.
        """
        self.wait()
        if self._state != "resident":
            raise OffloadError(f"offload: the handle is {self._state}, not resident ({self!r})")
        resized = [s.label for s in self._slots if s.storage.nbytes() != s.nbytes]
        if resized:
            raise OffloadError(f"offload: {', '.join(resized)} changed size since the reload")
        if not rewrite and (self._region is not None or self._manifest is not None):
            changed = self._mismatches() if self._verify else []
            if changed:
                raise OffloadChecksumError(changed, "changed since the reload (rewrite=False)")
            _registry.add(self._keys, self)
            self._free()
            self._state = "offloaded"
            return self
        self._drop_copy(unlink=False)  # the new file takes the old one's name, atomically
        self._state = "offloading"
        self._offload(non_blocking=non_blocking, nvme_file=None)
        return self

    def reclaim(self) -> OffloadHandle:
        """The storages back at their size without reading their bytes, which are dropped
        (the file goes, or the host copy): for a caller about to overwrite every byte, as an
        optimizer step overwrites a parameter shard. What they hold until then is undefined;
        the next `offload` writes them anew (``rewrite`` or not: there is no copy to keep)."""
        self.wait()  # an offload still in flight completes first (and raises if it failed)
        if self._state != "offloaded":
            raise OffloadError(f"reclaim: the handle is {self._state}, not offloaded ({self!r})")
        self._restore()
        self._drop_copy()
        _registry.remove(self._keys, self)
        self._state = "resident"
        return self

    def discard_copy(self) -> None:
        """Give back the copy that ``reload(keep=True)`` kept (its host memory, its file)."""
        self.wait()  # a reload still reading the copy finishes first
        if self.offloaded:
            raise OffloadError(f"discard_copy: the copy is where the bytes are ({self!r})")
        self._drop_copy()

    def _drop_copy(self, *, unlink: bool = True) -> None:
        region, self._region = self._region, None
        if region is not None:
            region.release()
        manifest, self._manifest = self._manifest, None
        if manifest is not None and unlink:  # the name goes now, the blocks on a thread
            self._offloader.io.remove(manifest.path)

    def _resident(self) -> None:
        bad = self._mismatches() if self._verify else []
        _registry.remove(self._keys, self)
        self._state = "resident"
        if bad:  # the bytes are back but wrong: say which, loudly
            raise OffloadChecksumError(bad, "their checksum at offload does not match")

    def _mismatches(self) -> list[str]:
        bad = []
        for slot in self._slots:
            now = None if slot.fingerprint is None else fingerprint(byte_view(slot.storage))
            if now != slot.fingerprint:
                bad.extend(slot.names)
        return bad


class _AllOf:
    """A fence over several CUDA events (a region read by copies on several GPUs)."""

    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self._events = events

    def query(self) -> bool:
        return all(e.query() for e in self._events)  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        for e in self._events:
            e.synchronize()


def _by_device(segments: list[Segment]) -> dict[torch.device, list[Segment]]:
    grouped: dict[torch.device, list[Segment]] = {}
    for seg in segments:
        grouped.setdefault(seg.device, []).append(seg)
    return grouped


def _fences(devices: frozenset[torch.device]) -> dict[torch.device, torch.cuda.Event]:
    """An event on the caller's current stream of each GPU: I/O threads start after it."""
    fences = {}
    for device in devices:
        if device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            fences[device] = event
    return fences
