"""Storages, not tensors, are what zoffload moves.

[Note: storages]
Offload empties a tensor's untyped storage with ``resize_(0)`` and reload resizes the same
storage object back and copies the bytes in, so every tensor, view and optimizer entry that
points at it stays valid. Several named tensors may share one storage (views, tied weights);
each storage is moved once, whole, including bytes no named view covers, so strides,
offsets and non-contiguous views all come back exactly. The flip side: every view of an
offloaded storage, named or not, is empty until reload. Reading such a tensor is undefined
(on CPU it crashes the process; on CUDA it reads freed memory), as with FSDP's freed
parameters. A reloaded CUDA storage usually sits at a new address: CUDA graphs that captured
the old one must be re-captured.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from zoffload._errors import OffloadError

__all__ = ["Slot", "byte_view", "collect", "fingerprint", "host_memoryview", "storage_key"]

# Words hashed per step on a device: bounds the int64 temporaries to 128 MiB.
_HASH_STEP = 1 << 24
_HASH_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit constant


@dataclass(eq=False)
class Slot:
    """One storage to move, with every name that points into it."""

    storage: torch.UntypedStorage
    nbytes: int  # size at offload; reload resizes back to it
    device: torch.device
    names: list[str]
    # The tensors themselves, so nothing the caller named dies while its bytes are away.
    tensors: list[torch.Tensor] = field(default_factory=list)
    offset: int = 0  # where the bytes lie in the handle's host region or file data
    fingerprint: int | None = None  # set when the offload was asked to verify
    # Host storages, at an NVMe offload: byte ranges of whole zero blocks, storage-relative,
    # that the reload hands back instead of writing ([Note: zero pages] in _pages).
    zeros: list[tuple[int, int]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.names[0] if len(self.names) == 1 else "/".join(self.names)


def storage_key(t: torch.Tensor) -> int:
    """An identity for ``t``'s storage that all its views share while it lives."""
    return int(t.untyped_storage()._cdata)


def collect(tensors: Mapping[str, torch.Tensor]) -> list[Slot]:
    """The distinct storages under ``tensors``, checked before anything is touched."""
    slots: dict[int, Slot] = {}
    for name, t in tensors.items():
        _check(name, t)
        key = storage_key(t)
        slot = slots.get(key)
        if slot is None:
            storage = t.untyped_storage()
            slot = Slot(storage, storage.nbytes(), t.device, [])
            slots[key] = slot
        slot.names.append(name)
        slot.tensors.append(t)
    return list(slots.values())


def _check(name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise OffloadError(
            f"{name!r}: only strided (dense) tensors can be offloaded, not {t.layout}"
        )
    if t.device.type == "meta":
        raise OffloadError(f"{name!r}: a meta tensor has no bytes to offload")
    if t.device.type not in ("cpu", "cuda"):
        raise OffloadError(f"{name!r}: tensors on {t.device.type} are not supported (cpu, cuda)")
    if not t.untyped_storage().resizable():
        # torch.frombuffer, from_blob, NumPy-backed: their memory belongs to someone else.
        raise OffloadError(f"{name!r}: its storage is not resizable (memory owned outside torch)")


def byte_view(storage: torch.UntypedStorage, nbytes: int | None = None) -> torch.Tensor:
    """A flat ``uint8`` tensor over the first ``nbytes`` bytes of ``storage``, no copy."""
    n = storage.nbytes() if nbytes is None else nbytes
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, 0, (n,), (1,))


def host_memoryview(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview; keep ``t`` alive."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("host_memoryview needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def fingerprint(view: torch.Tensor) -> int:
    """A cheap integrity hash of a ``uint8`` tensor's bytes, computed where they lie.

    CRC-32 on the host (several GB/s, no temporaries); on a GPU a position-weighted 64-bit
    sum of 32-bit words computed there, so verifying costs no transfer. Not cryptographic:
    it catches corruption, truncation and misplaced bytes, not an adversary.
    """
    if view.device.type == "cpu":
        return zlib.crc32(host_memoryview(view))
    return device_hash(view)


def device_hash(view: torch.Tensor) -> int:
    """The position-weighted word sum `fingerprint` uses off the host (works anywhere)."""
    n = view.numel()
    words = n // 4
    total = torch.zeros((), dtype=torch.int64, device=view.device)
    body = view[: words * 4].view(torch.int32)
    for start in range(0, words, _HASH_STEP):
        w = body[start : start + _HASH_STEP].to(torch.int64)
        total += _weighted_sum(w, start)
    tail = view[words * 4 :].to(torch.int64)
    total += _weighted_sum(tail, words)
    return (int(total.item()) ^ n) & 0xFFFFFFFFFFFFFFFF


def _weighted_sum(w: torch.Tensor, start: int) -> torch.Tensor:
    # Odd, position-dependent multipliers (wrapping int64): a swap or a moved word changes
    # the sum, a flipped bit changes it by an odd multiple of a power of two.
    pos = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
    mul = pos * _HASH_MUL | 1
    return ((w + 0x5BD1E995) * mul).sum()
