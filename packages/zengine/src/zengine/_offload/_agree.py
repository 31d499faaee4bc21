"""Ranks agree on NVMe faults: every rank raises the same named error, or none does.

[Note: NVMe faults agreed]
A full disk, a read-only one or an I/O error is seen by one rank; its peers would go on into
the next collective and hang, or fail later with something unrelated. So before state moves
to NVMe each rank checks its folder (there, a writable directory, the space it needs) and the
ranks all-gather what they found; ranks on one filesystem (the same host and ``st_dev``) add
up what they need, since each sees the same free space. After the writes (made with
``commit=False``: the bytes stay) they all-gather whether their writes succeeded, and only
when every rank's did does any rank empty its tensors. A failure anywhere raises one
`NvmeError` (`NvmeSpaceError` when space is all that is wrong) with the same message on every
rank, naming each failing rank's path, the bytes it needed and the bytes free; nothing moved.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

import zcomm
import zoffload
from zoffload import NvmeError, NvmeSpaceError

__all__ = ["agree_on_folders", "agree_on_outcome", "agree_on_swaps"]


@dataclass(frozen=True)
class _Finding:
    rank: int
    host: str
    path: str
    device: int
    needed: int
    free: int | None
    problem: str | None
    space: bool


def _gather(mine: object, group: dist.ProcessGroup | None) -> list[object]:
    if not dist.is_available() or not dist.is_initialized():
        return [mine]
    found: list[object] = [None] * dist.get_world_size(group)
    zcomm.all_gather_object(found, mine, group=group)  # torch's needs NumPy
    return found


def _rank() -> int:
    """This process's global rank, as the messages name ranks (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _raise(failed: Sequence[_Finding], what: str, after: str = "nothing moved") -> None:
    lines = []
    for f in failed:
        line = f"rank {f.rank} ({f.host}): {f.path}: {f.problem}"
        if f.space:
            line += f" ({_amount(f.needed)} to write, {_amount(f.free)} free)"
        lines.append(line)
    message = f"NVMe offload ({what}) failed, raised on every rank, {after}: " + "; ".join(lines)
    first = failed[0]
    if all(f.space for f in failed):
        raise NvmeSpaceError(
            first.path, first.problem or "", needed=first.needed, free=first.free, message=message
        )
    raise NvmeError(first.path, first.problem or "", message=message)


def _amount(nbytes: int | None) -> str:
    if nbytes is None:
        return "unknown"
    return f"{nbytes} bytes" if nbytes < 1 << 20 else f"{nbytes} bytes ({nbytes / 2**20:.1f} MiB)"


def agree_on_folders(
    needs: Sequence[tuple[str | os.PathLike[str], int]],
    group: dist.ProcessGroup | None,
    what: str,
) -> None:
    """Check this rank's NVMe folders (made if missing) for the bytes each needs, and agree:
    every rank raises the same error if any folder on any rank fails ([Note: NVMe faults
    agreed]). Collective over `group`; ``needs`` may differ (or be empty) between ranks."""
    rank, host = _rank(), socket.gethostname()
    mine = []
    for path, needed in needs:
        found = zoffload.inspect_folder(path, 0)  # space is judged per filesystem, below
        mine.append(
            _Finding(rank, host, str(Path(path)), found.device, needed, found.free,
                     found.problem, found.space)
        )  # fmt: skip
    everyone = [f for part in _gather(mine, group) for f in part]  # type: ignore[attr-defined]
    failed = [f for f in everyone if f.problem is not None]
    by_disk: dict[tuple[str, int], list[_Finding]] = {}
    for f in everyone:
        if f.problem is None and f.device >= 0:
            by_disk.setdefault((f.host, f.device), []).append(f)
    for sharing in by_disk.values():
        total = sum(f.needed for f in sharing)
        free = min((f.free for f in sharing if f.free is not None), default=None)
        if free is not None and total > free:
            ranks = sorted({f.rank for f in sharing})
            problem = (
                f"not enough free space: ranks {ranks} write {total} bytes to this filesystem"
                if len(ranks) > 1
                else "not enough free space"
            )
            failed += [
                _Finding(f.rank, f.host, f.path, f.device, f.needed, free, problem, True)
                for f in sharing
            ]
    if failed:
        _raise(sorted(failed, key=lambda f: (f.rank, f.path)), what)


def agree_on_outcome(
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    what: str,
    after: str = "nothing moved",
) -> None:
    """After the writes: every rank raises one named error if any rank's failed (its own
    error chained on the rank that saw it), else returns ([Note: NVMe faults agreed])."""
    rank, host = _rank(), socket.gethostname()
    mine = None
    if error is not None:
        if isinstance(error, NvmeError):
            mine = _Finding(rank, host, str(error.path), -1, error.needed or 0, error.free,
                            error.problem, isinstance(error, NvmeSpaceError))  # fmt: skip
        else:
            mine = _Finding(rank, host, "?", -1, 0, None, f"{type(error).__name__}: {error}", False)
    failed = [f for f in _gather(mine, group) if f is not None]
    if not failed:
        return
    try:
        _raise(failed, what, after)  # type: ignore[arg-type]
    except NvmeError as agreed:
        raise agreed from error


class _Swaps(Protocol):
    def take_failure(self) -> zoffload.OffloadError | None: ...


def agree_on_swaps(swappers: Sequence[_Swaps | None], group: dist.ProcessGroup | None) -> None:
    """At a step: every rank raises one named error if a swap file write failed on any rank
    since the last step (the state it was to hold stayed in memory, bit-exact). One small
    all-gather per step, only where ZeRO-Infinity's NVMe swaps are on."""
    present = [s for s in swappers if s is not None]
    if not present:
        return
    failure = None
    for swapper in present:
        failure = swapper.take_failure() or failure
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([0.0 if failure is None else 1.0])
        zcomm.all_reduce(flag, op=zcomm.ReduceOp.MAX, group=group)  # the usual case: one flag
        if not flag.item():
            return
    after = "the state a failed write was to hold stays in memory, bit-exact"
    agree_on_outcome(failure, group, "ZeRO-Infinity swap files", after)
