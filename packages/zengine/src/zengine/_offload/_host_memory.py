"""Handing freed host memory back to the system: at once (`trim_heap`), or once the engine has
sat idle a while (`IdleTrimmer`).

[Note: returning memory on CPU]
On CPU torch allocates with malloc. A ZeRO-3 step frees hundreds of MiB it gathered (full
parameters, full gradients, reduce buffers) and its activations; glibc keeps that in its heap
for reuse, so the process's resident memory stays near the step's peak though the live tensors
are only the model states (measured at hidden 1024, 2 ranks: 1.25 GiB resident for 0.5 GiB of
tensors, 0.87 GiB after `malloc_trim`). Trimming after every step costs the next step what it
takes to fault the memory back in (measured on the 2-core VM: 16 ms for the trim and about 9%
of a step in page faults; a page costs about 3.4 us to fault and zero there). So, as jemalloc
and Go's scavenger do, the heap is trimmed only once the engine has been idle for `IDLE_AFTER`
seconds after an optimizer step or an evaluation (a forward without gradients): a training
loop, whose next forward comes within milliseconds, keeps its heap warm; a process that has
finished, waits for data or lets another program run between steps gives the memory back.
The config's ``host_memory_trim`` picks otherwise: ``step`` trims at the end of every step (the
process holds little more than its model states between steps, and pays the faults at each),
``off`` leaves it all to glibc (no hold below either).

For the same reason glibc's own trimming inside `free()` is turned off once an engine on CPU
is built (`_hold_heap`; for the rest of the process: glibc has no way back to its dynamic
thresholds). By default glibc hands the top of the heap back whenever more than twice its mmap
threshold lies free there, which a ZeRO-3 step on CPU brings about several times over (the
gathered parameters and reduce buckets are freed together), and the step after faults it all in
again. Measured at hidden 256 on 2 ranks (15 steps in a row): 41-48 thousand page faults a step
against DDP's 26-33 thousand, 18-23 thousand with the hold; the step's CPU time 1.08-1.10x DDP's
without it, 0.97-1.00x with it. The mmap threshold is fixed at glibc's own ceiling (32 MiB,
where its dynamic threshold ends up for tensors this size; setting either turns the adjustment
of both off). It is set again at each engine built: zpartition's `Init`, building a model on
the host, fixes the mmap threshold at 128 KiB (its ``_host_heap``), and the last to set it
wins. A user's own ``MALLOC_*_`` variables or ``glibc.malloc`` tunables are left as they are.

The gradient partitions are a buffer the engine keeps (DeepSpeed's ``grad_partitions_flat_buffer``,
which views and ``safe_get_*`` point into), where FSDP2 frees its sharded gradients at each
``zero_grad``. Zeroing it after a step by hand (`zero_releasing_pages`) gives a large one's pages
back to the system instead of writing zeros into them, so between steps it costs no resident
memory, as freed gradients would not, and the next backward finds zeroed pages (measured at
hidden 1024 on 2 ranks: 128 MiB a rank less resident between steps). A buffer under glibc's
mmap threshold is zeroed in place: glibc keeps blocks that size in its heap anyway.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import weakref
from collections.abc import Callable

import torch

from zoffload import release_pages

__all__ = ["IDLE_AFTER", "IdleTrimmer", "trim_heap", "zero_releasing_pages"]

IDLE_AFTER = 1.0  # seconds without a forward after a step (or an evaluation) before a trim
_TRIM_ABOVE = 64 << 20  # free heap bytes worth handing back
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_MMAP_AT = 32 << 20  # glibc's largest mmap threshold on 64-bit systems
_NEVER = 2**31 - 1  # mallopt takes an int: free() trims only above 2 GiB free at the top
_USER_KNOBS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


class _MallInfo2(ctypes.Structure):
    _fields_ = [  # glibc's struct mallinfo2: ten size_t counters
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def _glibc_trimmer(above: int) -> Callable[[], None] | None:
    """glibc's ``malloc_trim`` when the heap holds more than ``above`` bytes free; None where
    there is no glibc. ctypes lets go of the GIL during both calls."""
    try:
        libc = ctypes.CDLL(None)
        trim, info = libc.malloc_trim, libc.mallinfo2
    except (AttributeError, OSError):
        return None
    trim.argtypes, info.restype = [ctypes.c_size_t], _MallInfo2

    def run() -> None:
        if info().fordblks > above:
            trim(0)

    return run


def _hold_heap() -> None:
    """glibc's ``free()`` stops handing the heap's top back, and blocks under 32 MiB come from
    the heap (see the Note). Not where the user tuned glibc's malloc."""
    tuned = any(k in os.environ for k in _USER_KNOBS)
    if tuned or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(_M_MMAP_THRESHOLD, _MMAP_AT)
    mallopt(_M_TRIM_THRESHOLD, _NEVER)


def zero_releasing_pages(tensor: torch.Tensor) -> None:
    """``tensor.zero_()``, for a buffer the caller allocated (private memory, not shared or
    mapped from a file) that stays idle a while after: on CPU, when it is at least glibc's mmap
    threshold (a block that size is handed back to the system when freed), its whole pages are
    handed back instead of written (``MADV_DONTNEED``: they read as zeros, and the kernel
    supplies zeroed pages at the first write), and only the partial pages at its ends are
    zeroed. As torch's ``zero_grad(set_to_none=True)`` frees the gradients FSDP2 holds between
    steps, without the views of the buffer going stale."""
    if tensor.numel() * tensor.element_size() < _MMAP_AT:
        tensor.zero_()  # a smaller block is glibc's heap's to reuse: writing is as cheap
        return
    release_pages(tensor)


def trim_heap() -> None:
    """Hand every free page of the heap back to the system now (where glibc is the malloc)."""
    run = _glibc_trimmer(0)
    if run is not None:
        run()


class IdleTrimmer:
    """Trims the heap from a background thread once `idle` was called and `busy` was not
    called again within ``after`` seconds, and takes the trimming out of glibc's ``free()``
    meanwhile. Without glibc, or not ``enabled``, it does nothing."""

    def __init__(
        self,
        after: float = IDLE_AFTER,
        above: int = _TRIM_ABOVE,
        *,
        enabled: bool = True,
        also: Callable[[], object] | None = None,
    ) -> None:
        """`after`: seconds idle before a trim; `above`: the free bytes worth a trim; `also`:
        more to give back at each trim (zoffload's unpinned staging buffers)."""
        self.after = after
        self.trims = 0  # how many trims ran (for tests and curiosity)
        self._also = also
        self._run = _glibc_trimmer(above) if enabled else None
        if self._run is not None:
            _hold_heap()
        self._deadline: float | None = None  # when to trim; None: not armed
        self._closed = False
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def idle(self) -> None:
        """A step ended: trim if nothing starts within ``after`` seconds."""
        if self._run is None:
            return
        with self._wake:
            self._deadline = time.monotonic() + self.after
            if self._thread is None or not self._thread.is_alive():  # (a fork has no thread)
                self._thread = threading.Thread(
                    target=self._loop, name="zengine-idle-trim", daemon=True
                )
                self._thread.start()
                _running.add(self)
            self._wake.notify()

    def now(self) -> None:
        """Trim at once, in this thread (``host_memory_trim: step``)."""
        if self._run is not None:
            self._deadline = None
            self._trim()

    def busy(self) -> None:
        """Work started: the heap's free memory is about to be used again."""
        self._deadline = None  # one store; the thread reads it under the lock

    def close(self) -> None:
        """Stop the thread, and wait for it (a trim under way takes milliseconds)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _loop(self) -> None:
        assert self._run is not None
        while True:
            with self._wake:
                while not self._closed:
                    if self._deadline is None:
                        self._wake.wait()
                        continue
                    left = self._deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                if self._closed:
                    return
                self._deadline = None
            self._trim()

    def _trim(self) -> None:
        assert self._run is not None
        if self._also is not None:
            self._also()
        self._run()
        self.trims += 1


# Threads are stopped while the interpreter still runs: a daemon thread inside malloc_trim
# when the interpreter finalizes would be cut off as it takes the GIL back.
_running: weakref.WeakSet[IdleTrimmer] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for trimmer in list(_running):
        trimmer.close()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) has no trim thread, and the parent's thread may
    have held the lock at the fork: each trimmer starts afresh."""
    for trimmer in list(_running):
        trimmer._wake = threading.Condition()
        trimmer._thread = None
        trimmer._deadline = None


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
