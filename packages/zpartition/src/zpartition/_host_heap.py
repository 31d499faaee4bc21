"""glibc's mmap threshold fixed while `Init` cuts shards into host memory.

[Note: the heap while Init builds on CPU]
On CPU torch allocates with malloc. glibc serves a block of at least its mmap threshold (128
KiB at the start) with a mapping of its own, unmapped when freed, and raises the threshold to
the size of each such block freed, up to 32 MiB. Building a model under `Init` allocates each
module whole, then its shards, then frees the whole: after the first large free, blocks under
the new threshold come from the heap, where the long-lived shards interleave with the freed
wholes, and glibc keeps the holes (it hands back only free memory at the top). Measured with a
68 MiB Llama at 2 ranks: +148 MiB resident per rank after construction (2.2x the model, the
shards being 0.5x), +35-43 MiB with the threshold fixed at 128 KiB; ``malloc_trim`` after each
module's cut gave a peak of 1.0-1.3x and 0.6x after. So the outermost `Init` that keeps shards
in host memory fixes the threshold at 128 KiB, glibc's starting value (setting it turns the
adjustment off): every large tensor is mapped on its own and unmapped when freed. It is left
fixed after: the load that usually follows (Transformers' per-module ``GatheredParameters``,
``zengine.load_safetensors``) frees large blocks as well. It is set at every such `Init` (one
call), not once per process, so the bound holds whatever ran before; zengine raises the
threshold to 32 MiB when it builds an engine on CPU, for training steps that free and
allocate the same sizes again (zengine's [Note: returning memory on CPU]), so whichever
comes last wins. The cost: fresh mappings fault their pages in, each time memory is freed
and allocated again (a 245 M-parameter Llama at 2 ranks, built and loaded by zengine: 1.02 s
-> 1.15 s; by Transformers' ZeRO-3 path, which gathers every module once: 5.8 s -> 7.9 s, its
peak 2.3x -> 1.65x the model; BENCHMARKS.md). A user's own ``MALLOC_*_`` variables or
``glibc.malloc`` tunables are left as they are; without glibc's ``mallopt``, nothing.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["fix_mmap_threshold"]

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_MMAP_AT = 128 << 10  # glibc's starting mmap threshold
_USER_KNOBS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def fix_mmap_threshold() -> None:
    """Blocks of 128 KiB or more mapped on their own from now on (see the Note)."""
    if any(k in os.environ for k in _USER_KNOBS):
        return
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):  # not glibc (musl, macOS, Windows)
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(_M_MMAP_THRESHOLD, _MMAP_AT)
