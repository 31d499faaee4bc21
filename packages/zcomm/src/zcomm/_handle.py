"""The handle every zcomm operation returns: wait on it before reading the result.

A handle wraps torch's ``Work`` and adds what must happen once the data has arrived: copies
out of a flat buffer, the division of an emulated average, and the accounting record. Errors
from torch are re-raised naming the operation, the group and the rank.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from zcomm import _accounting, _nodes
from zcomm._errors import CommError, comm_error
from zcomm._watchdog import SLICE, wait_slowly

__all__ = ["Handle", "completed", "run"]


class Handle:
    """The result of a collective or point-to-point call.

    ``wait()`` blocks until the operation completed (it is already complete for synchronous
    calls and for the world-of-one fast path) and is idempotent.
    """

    __slots__ = (
        "_done",
        "_finish",
        "_group",
        "_nbytes",
        "_op",
        "_peer",
        "_sliced",
        "_start",
        "_work",
    )

    def __init__(
        self,
        op: str,
        group: dist.ProcessGroup | None,
        work: dist.Work | None,
        *,
        finish: Callable[[], None] | None = None,
        nbytes: int = 0,
        peer: int | None = None,
        sliced: bool = False,
    ) -> None:
        self._op = op  # for error messages and accounting
        self._sliced = sliced  # a host collective: waited in slices ([Note: the watchdog])
        self._group = group
        self._peer = peer  # a point-to-point operation's other rank: its link class
        self._work = work  # None once complete (or when nothing was sent)
        self._finish = finish  # runs once, after the data arrived
        self._nbytes = nbytes
        self._start = time.perf_counter() if _accounting.enabled() else 0.0
        self._done = False

    def __repr__(self) -> str:
        state = "done" if self._done else "in flight"
        return f"Handle({self._op}, {state})"

    @property
    def op(self) -> str:
        """The name of the operation, e.g. ``"all_reduce"``."""
        return self._op

    def is_completed(self) -> bool:
        """Whether the operation has finished (without blocking)."""
        return self._done or self._work is None or bool(self._work.is_completed())

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the operation has completed; raises `CommError` if it failed."""
        if self._done:
            return True
        work, self._work = self._work, None
        if work is not None:
            try:
                if not self._sliced:
                    work.wait() if timeout is None else work.wait(timeout)
                elif timeout is not None and timeout <= SLICE:
                    work.wait(timeout)
                else:
                    try:
                        work.wait(SLICE)
                    except RuntimeError:
                        wait_slowly(work, self._op, self._group, timeout)
            except CommError:
                self._done = True
                raise  # a staged collective's own handle said it ([Note: host tensors on NCCL])
            except RuntimeError as error:
                self._done = True
                raise comm_error(self._op, self._group, error) from error
        self._complete()
        return True

    def _complete(self) -> None:
        self._done = True
        if self._finish is not None:
            self._finish()
            self._finish = None
        if self._start and self._nbytes:
            _account(self._op, self._group, self._nbytes, self._start, self._peer)


def _account(
    op: str, group: dist.ProcessGroup | None, nbytes: int, start: float, peer: int | None
) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()  # time the transfer, not the launch (only while accounting)
    seconds = time.perf_counter() - start
    inter = _nodes.crosses_nodes(group, peer)
    _accounting.record(op, nbytes, seconds, dist.get_world_size(group), inter)


def run(
    op: str,
    group: dist.ProcessGroup | None,
    call: Callable[[bool], dist.Work | None],
    *,
    async_op: bool,
    nbytes: int,
    finish: Callable[[], None] | None = None,
    peer: int | None = None,
    sliced: bool = False,
) -> Handle:
    """Issue `call(async_op)` and return its handle; synchronous calls come back completed.
    `peer` is a point-to-point operation's other global rank. A `sliced` operation (one on
    host tensors, over gloo) is waited in slices, with the watchdog's checks between them
    ([Note: the watchdog])."""
    if not async_op and finish is None and not _accounting.enabled():
        # The common call: synchronous, nothing to finish, nothing to record. A completed
        # handle never changes, so one per operation serves every such call, and the hot
        # path costs the torch call and little more. Sliced, it is issued async and waited
        # once with a timeout: the same two calls torch makes for a synchronous one.
        try:
            if not sliced:
                call(False)
            else:
                work = call(True)
                if work is not None:
                    try:
                        work.wait(SLICE)
                    except RuntimeError:
                        wait_slowly(work, op, group)
        except CommError:
            raise  # the watchdog's, or the slow wait's wrapping of torch's
        except RuntimeError as error:
            raise comm_error(op, group, error) from error
        return _done(op)
    handle = Handle(op, group, None, finish=finish, nbytes=nbytes, peer=peer, sliced=sliced)
    try:
        work = call(async_op)
    except RuntimeError as error:
        raise comm_error(op, group, error) from error
    handle._work = work
    if not async_op:
        handle.wait()
    return handle


def completed(op: str, finish: Callable[[], None] | None = None) -> Handle:
    """A handle for an operation that needed no communication (the world-of-one fast path)."""
    if finish is None:
        return _done(op)
    handle = Handle(op, None, None, finish=finish)
    handle._complete()
    return handle


@functools.cache
def _done(op: str) -> Handle:
    """The shared completed handle of `op`."""
    handle = Handle(op, None, None)
    handle._complete()
    return handle
