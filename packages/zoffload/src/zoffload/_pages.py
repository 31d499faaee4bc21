"""Host pages that read as zeros without being resident: finding them and making them so.

[Note: zero pages]
A large buffer zeroed by handing its pages back (zengine's gradient partitions between steps)
reads as zeros but occupies no memory until it is written. Offloading it and writing the
zeros back at reload would make it resident: the process would come back larger than it left.
So for host storages the zero runs are found at offload (`zero_runs`, whole blocks of
``ZERO_BLOCK`` bytes, counted from the storage's start) and at reload they are zeroed with
`release_pages` instead of written: whole pages are handed back (``MADV_DONTNEED``: private memory
then reads as zeros, and the kernel supplies a zeroed page at the first write), and only the
partial pages at the run's ends are written. A run of zeros that was resident comes back
non-resident, which costs a page fault at its first write and never more memory.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import torch

__all__ = ["PAGE", "ZERO_BLOCK", "release_pages", "zero_runs"]

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
ZERO_BLOCK = 1 << 16  # the granularity of zero runs: 16 pages, a few edge bytes at most
_MADV_DONTNEED = 4  # madvise's advice number (sys/mman.h, Linux)


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        call = ctypes.CDLL(None).madvise
    except (AttributeError, OSError):  # no libc madvise (Windows)
        return None
    call.argtypes, call.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return call


_madvise_call = _madvise()


def zero_runs(data: torch.Tensor, block: int = ZERO_BLOCK) -> list[tuple[int, int]]:
    """The byte ranges ``[start, stop)`` of ``data`` (flat ``uint8``, on the host) made of
    whole ``block``-byte blocks that are all zeros, merged; one vectorised pass. torch's
    ``any`` makes a temporary of an eighth of ``data``'s size: scan a large storage in windows
    (``_extents.find_zero_runs`` does)."""
    if data.device.type != "cpu" or data.dim() != 1 or data.dtype != torch.uint8:
        raise ValueError("zero_runs needs a flat uint8 tensor on the host")
    whole = data.numel() // block
    if whole == 0:
        return []
    blocks = data[: whole * block].view(whole, block)
    if data.data_ptr() % 8 == 0 and block % 8 == 0:
        blocks = blocks.view(torch.int64)  # eight bytes a compare
    zero = blocks.any(dim=1).logical_not()  # (any of uint8 is uint8, not bool)
    if not bool(zero.any()):
        return []
    # run boundaries: where the flag changes, with a False on either side
    flags = torch.cat([zero.new_zeros(1), zero, zero.new_zeros(1)]).to(torch.int8)
    edges = torch.nonzero(flags.diff()).flatten().tolist()
    return [(edges[i] * block, edges[i + 1] * block) for i in range(0, len(edges), 2)]


def release_pages(tensor: torch.Tensor) -> None:
    """``tensor.zero_()``, handing the whole pages under a host tensor back to the system
    instead of writing them (``MADV_DONTNEED``: private memory then reads as zeros, and the
    kernel supplies a zeroed page at the first write); only the partial pages at its ends
    are written. Anything else is zeroed as ``zero_()`` does: a tensor on a device, not
    contiguous, pinned (its pages are locked by the CUDA driver), shared, or on a system
    without ``madvise``. The caller owns the memory (not mapped from a file)."""
    nbytes = tensor.numel() * tensor.element_size()
    start = tensor.data_ptr()
    lo, hi = -(-start // PAGE) * PAGE, (start + nbytes) // PAGE * PAGE
    if (
        _madvise_call is None
        or hi <= lo
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.is_pinned()
        or tensor.untyped_storage().is_shared()
        or _madvise_call(lo, hi - lo, _MADV_DONTNEED) != 0  # refused: an mlocked range, say
    ):
        tensor.zero_()
        return
    raw = tensor.view(-1).view(torch.uint8)
    raw[: lo - start].zero_()
    raw[hi - start :].zero_()
