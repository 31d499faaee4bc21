"""Closing the descriptors of deleted offload files on a thread (see [Note: deferred free] in
``_nvme``): the blocks of a file whose name is gone are freed at its last close, which on a
filesystem mounted with ``discard`` waits for the device to trim them."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["close_later", "wait"]

_lock = threading.Lock()  # held across fork: every descriptor in `_open` is open
_executor: ThreadPoolExecutor | None = None
_open: set[int] = set()  # descriptors waiting for their close
_pending: list[Future[None]] = []


def close_later(fd: int) -> None:
    """Close ``fd`` on the process's remover thread."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="zoffload-remove")
        _open.add(fd)
        # the closes done and fine are forgotten (a long run deletes files every step); a
        # failed one stays for `wait` to raise
        _pending[:] = [f for f in _pending if not f.done() or f.exception() is not None]
        _pending.append(_executor.submit(_close, fd))


def _close(fd: int) -> None:
    with _lock:  # out of `_open` first: a child forked in between keeps its copy open
        _open.discard(fd)  # (its files freed when it exits) but never closes a reused number
    os.close(fd)  # the trim, where there is one, outside the lock


def wait() -> None:
    """Wait until every descriptor given to `close_later` so far is closed: the space of the
    files deleted so far is free (``free_bytes`` calls it before it measures)."""
    with _lock:
        pending = list(_pending)
        _pending.clear()
    for future in pending:
        future.result()


def _after_fork_in_child() -> None:
    # A forked child has the descriptors but not the thread that closes them: it closes its
    # copies now (the parent's still hold the files, so this frees nothing and waits for
    # nothing); it would otherwise wait forever on closes that no thread runs.
    global _executor, _lock
    _lock = threading.Lock()
    _executor = None
    for fd in _open:
        os.close(fd)
    _open.clear()
    _pending.clear()


os.register_at_fork(
    before=lambda: _lock.acquire(),
    after_in_parent=lambda: _lock.release(),
    after_in_child=_after_fork_in_child,
)
