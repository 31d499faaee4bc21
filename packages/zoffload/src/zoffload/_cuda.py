"""Everything that touches CUDA; nothing here runs until a CUDA tensor or pinning is involved.

Two backends move bytes between one GPU and host memory, chosen once per process:

- CuPy (the ``cuda`` extra), when it imports and ``cupy.is_available()``: its own
  non-blocking streams (seen by torch as ``torch.cuda.ExternalStream``), ``memcpyAsync``
  for the link, one raw kernel that gathers (or scatters) every small storage of a
  segment, fed its pointer tables and staging buffer from torch through DLPack, no copies.
- torch otherwise: a torch stream, ``copy_(non_blocking=True)``, ``torch._foreach_copy_``.

Both pin host memory with ``cudaHostRegister`` on memory zoffload allocated itself, so a
block is exactly the size asked (torch's pinned allocator rounds up to a power of two).

[Note: stream order]
Copies run on the backend's stream, never the caller's. Before reading a storage, that stream
waits for the caller's current stream (whatever last wrote the tensor). A source freed
right after an asynchronous offload is marked with ``record_stream`` so the caching
allocator does not hand its memory out before the copy has read it. After a reload, the
caller's stream waits for the copy's event, so later kernels see the bytes without the host
blocking; only ``non_blocking=False`` (or ``wait()``) blocks the host.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from typing import Any

import torch

from zoffload._layout import Segment
from zoffload._storage import Slot, byte_view

__all__ = ["Copier", "copier", "cuda_available", "cupy", "register_host", "unregister_host"]

_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current device's
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the pointers (UVA)
_MAX_GRID_Y = 65535  # one kernel launch gathers at most this many storages

_GATHER_SOURCE = r"""
extern "C" __global__ void zoffload_gather(
    const unsigned long long* ptrs, const unsigned long long* offsets,
    const unsigned long long* sizes, unsigned char* packed, int scatter) {
  const int i = blockIdx.y;
  unsigned char* item = (unsigned char*)ptrs[i];
  unsigned char* slot = packed + offsets[i];
  const unsigned long long n = sizes[i];
  const unsigned long long n16 = n / 16;
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  uint4* item4 = (uint4*)item;  // storages are 512-byte aligned, slots 64-byte aligned
  uint4* slot4 = (uint4*)slot;
  for (unsigned long long k = first; k < n16; k += step) {
    if (scatter) item4[k] = slot4[k]; else slot4[k] = item4[k];
  }
  for (unsigned long long k = n16 * 16 + first; k < n; k += step) {
    if (scatter) item[k] = slot[k]; else slot[k] = item[k];
  }
}
"""


def cuda_available() -> bool:
    """Whether a CUDA device is usable; does not initialize CUDA."""
    return torch.cuda.is_available()


@functools.cache
def cupy() -> Any | None:
    """The CuPy module when it is installed and sees a GPU; ``None`` otherwise.

    ``ZOFFLOAD_BACKEND=torch`` forces the torch backend (for comparisons and debugging).
    """
    if os.environ.get("ZOFFLOAD_BACKEND", "").lower() == "torch":
        return None
    try:
        cp = importlib.import_module("cupy")  # the optional extra, imported on first use
    except ImportError:
        return None
    try:
        return cp if cp.is_available() else None
    except Exception:  # a broken CUDA install: the torch path still works
        return None


def register_host(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for DMA (``cudaHostRegister``)."""
    cp = cupy()
    if cp is not None:
        cp.cuda.runtime.hostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE)
        return
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    code = int(cudart.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}")


def unregister_host(ptr: int) -> None:
    """Undo `register_host` (synchronizes the device, so only when a pool block is freed)."""
    cp = cupy()
    if cp is not None:
        cp.cuda.runtime.hostUnregister(ptr)
        return
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    code = int(cudart.cudaHostUnregister(ptr))
    if code != 0:
        raise RuntimeError(f"cudaHostUnregister failed with CUDA error {code}")


_copiers: dict[torch.device, Copier] = {}
_copiers_lock = threading.Lock()


def copier(device: torch.device) -> Copier:
    """The process-wide copier of one GPU (its streams are made once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    with _copiers_lock:
        found = _copiers.get(device)
        if found is None:
            found = _CupyCopier(device) if cupy() is not None else Copier(device)
            _copiers[device] = found
        return found


class Copier:
    """Moves segments between one GPU and host memory on two streams of its own (torch)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = self._new_stream()  # offloads: device to host
        self.h2d = self._new_stream()  # reloads: a second stream, so both directions overlap

    def _new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def to_host(self, segments: list[Segment], host: torch.Tensor) -> torch.cuda.Event:
        """Copy ``segments`` into ``host`` (a uint8 region); the event marks the end."""
        stream = self.d2h
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for seg in segments:
                dst = host[seg.offset : seg.offset + seg.nbytes]
                if seg.packed:
                    staging = torch.empty(seg.nbytes, dtype=torch.uint8, device=self.device)
                    self._gather(seg, staging, scatter=False)
                    self._memcpy(dst, staging)
                else:
                    self._memcpy(dst, byte_view(seg.slots[0].storage))
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        for seg in segments:
            for slot in seg.slots:
                byte_view(slot.storage).record_stream(stream)  # see [Note: stream order]
        return event

    def to_device(self, segments: list[Segment], host: torch.Tensor) -> torch.cuda.Event:
        """Copy ``host`` back into the (re-allocated) storages of ``segments``."""
        stream = self.h2d
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)  # the storages were allocated on the caller's stream
        with torch.cuda.stream(stream):
            for seg in segments:
                src = host[seg.offset : seg.offset + seg.nbytes]
                if seg.packed:
                    staging = torch.empty(seg.nbytes, dtype=torch.uint8, device=self.device)
                    self._memcpy(staging, src)
                    self._gather(seg, staging, scatter=True)
                else:
                    self._memcpy(byte_view(seg.slots[0].storage), src)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        for seg in segments:
            for slot in seg.slots:
                byte_view(slot.storage).record_stream(stream)
        current.wait_event(event)
        return event

    def _memcpy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def _gather(self, seg: Segment, packed: torch.Tensor, *, scatter: bool) -> None:
        views = [byte_view(s.storage) for s in seg.slots]
        slices = [packed[s.offset - seg.offset :][: s.nbytes] for s in seg.slots]
        if scatter:
            torch._foreach_copy_(views, slices)
        else:
            torch._foreach_copy_(slices, views)


class _CupyCopier(Copier):
    """The same moves through CuPy: its streams, ``memcpyAsync`` and one gather kernel."""

    def __init__(self, device: torch.device) -> None:
        cp = cupy()
        assert cp is not None
        self._cp = cp
        self._cupy_streams: list[Any] = []  # torch's ExternalStream does not own them
        with cp.cuda.Device(device.index):
            self._kernel = cp.RawKernel(_GATHER_SOURCE, "zoffload_gather")
        super().__init__(device)

    def _new_stream(self) -> torch.cuda.Stream:
        with self._cp.cuda.Device(self.device.index):
            stream = self._cp.cuda.Stream(non_blocking=True)
        self._cupy_streams.append(stream)
        external: torch.cuda.Stream = torch.cuda.ExternalStream(  # type: ignore[no-untyped-call]
            stream.ptr, device=self.device
        )
        return external

    def _memcpy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(self.device)  # one of ours, inside to_host/to_device
        n = dst.numel()
        self._cp.cuda.runtime.memcpyAsync(
            dst.data_ptr(), src.data_ptr(), n, _MEMCPY_DEFAULT, stream.cuda_stream
        )

    def _gather(self, seg: Segment, packed: torch.Tensor, *, scatter: bool) -> None:
        for first in range(0, len(seg.slots), _MAX_GRID_Y):
            self._launch(seg, seg.slots[first : first + _MAX_GRID_Y], packed, scatter=scatter)

    def _launch(
        self, seg: Segment, slots: list[Slot], packed: torch.Tensor, *, scatter: bool
    ) -> None:
        cp = self._cp
        stream = torch.cuda.current_stream(self.device)
        table = torch.tensor(
            [
                [s.storage.data_ptr() for s in slots],
                [s.offset - seg.offset for s in slots],
                [s.nbytes for s in slots],
            ],
            dtype=torch.int64,
        ).to(self.device)
        largest = max(s.nbytes for s in slots)
        blocks_x = min(1024, max(1, -(-largest // (16 * 256))))
        with cp.cuda.ExternalStream(stream.cuda_stream, self.device.index):
            # DLPack: CuPy views torch's memory in place. Made inside the block, CuPy asks
            # for the tensors on torch's current stream, ours, so the handshake adds no wait.
            ptrs, offsets, sizes = (cp.from_dlpack(row) for row in table)
            staging = cp.from_dlpack(packed)
            self._kernel(
                (blocks_x, len(slots)),
                (256,),
                (ptrs, offsets, sizes, staging, cp.int32(1 if scatter else 0)),
            )
