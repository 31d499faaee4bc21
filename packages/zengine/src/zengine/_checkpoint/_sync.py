"""How the ranks agree during a checkpoint save or load.

Every step of a save or load that can fail on one rank (a full disk, a corrupt file) ends in
`Sync.agree`: each rank says what went wrong, if anything, and then every rank raises the same
error naming every failed rank, so no rank hangs in a later collective waiting for one that
already gave up. `Sync.arrive` is where a rank that never comes is noticed: on gloo a monitored
barrier with the ``checkpoint.timeout`` names the ranks that did not arrive, and a rank whose
process is gone (gloo reports its closed connection as the barrier failing at once) is named as
crashed, not as late.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import zcomm
from zengine._checkpoint._errors import (
    CheckpointError,
    CheckpointMismatchError,
    ClientStateError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

__all__ = ["ERROR_KINDS", "Sync"]


class Sync:
    """The data-parallel group of an engine, for checkpoint agreement."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timedelta(seconds=timeout) if timeout is not None else None

    def arrive(self, op: str) -> None:
        """Wait until every rank has called `op`; a `zcomm.CommTimeoutError` naming the ranks
        that did not come within the timeout."""
        if self.world == 1:
            return
        if dist.get_backend(self.group) != "gloo":
            zcomm.barrier(group=self.group)  # the group's own timeout, named by zcomm
            return
        start = time.monotonic()
        try:
            dist.monitored_barrier(self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as error:
            raise self._absent(op, error, time.monotonic() - start) from error

    def _absent(self, op: str, error: RuntimeError, waited: float) -> zcomm.CommError:
        """The error of a monitored barrier that failed after `waited` seconds: a timeout
        naming the late ranks, or, when it failed before its timeout (gloo fails it as soon as
        a rank's connection closes), the rank that exited or crashed."""
        text = str(error)
        where = f"monitored_barrier at the start of {op}"
        group = f"the data-parallel group ({self.world} ranks)"
        limit = re.search(r"in (\d+) ms", text)
        if limit is not None and waited * 1000 >= 0.9 * int(limit.group(1)):
            return zcomm.CommTimeoutError(
                where,
                group,
                dist.get_rank(),
                f"{text} (those ranks did not call {op} in time: every rank must call it)",
            )
        listed = re.search(r"Ranks? ([\d, ]+) failed to pass", text)
        # every other rank hears from rank 0 only; rank 0 from every rank, and gloo names them
        # unless it saw a connection close first: then, of two ranks, the other one
        if self.rank != 0:
            ranks = str(self._global(0))
        elif listed is not None:
            ranks = ", ".join(str(self._global(int(r))) for r in re.findall(r"\d+", listed[1]))
        elif self.world == 2:
            ranks = str(self._global(1))
        else:
            others = sorted(self._global(r) for r in range(1, self.world))
            ranks = f"of {others} (gloo does not say which)"
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        return zcomm.CommError(
            where,
            group,
            dist.get_rank(),
            f"rank {ranks} exited or crashed instead of calling {op} (its connection closed "
            f"after {waited:.1f} s, before any timeout): {first}",
        )

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), in rank order.

        ``zcomm.all_gather_object``: ``dist.all_gather_object`` needs NumPy on CPU (torch
        calls ``tensor.numpy()`` to unpickle).
        """
        found: list[Any] = [None] * self.world
        zcomm.all_gather_object(found, value, group=self.group)
        return found

    def agree(
        self,
        what: str,
        error: str | BaseException | None,
        kind: type[CheckpointError] = CheckpointError,
    ) -> None:
        """Raise on every rank when `error` is set on any: the message names each failed rank
        and its error (once, when they all failed alike). The error is `kind`, or the class of
        the first failed rank's exception when that is a `CheckpointError`."""
        mine: tuple[str, str] | None = None
        if isinstance(error, BaseException):
            mine = (type(error).__name__, str(error))
        elif error is not None:
            mine = ("", error)
        errors = self.gather(mine)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        ranks = ", ".join(str(r) for r, _ in failed)
        messages = {message for _, (_, message) in failed}
        if len(messages) == 1:
            detail = messages.pop()
        else:
            detail = "\n  ".join(f"rank {r}: {message}" for r, (_, message) in failed)
        first = failed[0][1][0]
        chosen = next((c for c in ERROR_KINDS if c.__name__ == first), kind)
        raise chosen(f"{what} failed on rank {ranks}:\n  {detail}")


ERROR_KINDS = (
    CheckpointError,
    CheckpointMismatchError,
    ClientStateError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
