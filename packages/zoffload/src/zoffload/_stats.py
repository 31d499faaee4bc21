"""Process-wide counts of the bytes zoffload moves through its NVMe files.

[Note: NVMe accounting]
Every ``pwritev``/``preadv`` on an offload file adds the bytes the kernel reports moved, whichever
`Offloader` issued it (an engine may run several: one per kind of state), so that "the bytes a
training step moves through the disk" is one subtraction of two `nvme_stats` snapshots around
the step. The counts are what went to or came from the file: data chunks as written (padding
included, holes of zeros excluded, since they are never written or read), headers, and the
header reads of `read_manifest`. ``seconds`` is the wall time spent inside `NvmeIO.write` and
`NvmeIO.read` calls (overlapping calls on several threads each count), for a rough bandwidth.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["NvmeStats", "nvme_stats"]


@dataclass(frozen=True)
class NvmeStats:
    """A snapshot of zoffload's NVMe traffic in this process (see `nvme_stats`).

    Subtract two snapshots for the traffic in between: ``after - before``.
    """

    bytes_written: int = 0
    bytes_read: int = 0
    files_written: int = 0  # complete offload files (each `NvmeIO.write` that succeeded)
    files_read: int = 0  # offload files read back (each `NvmeIO.read` that succeeded)
    write_seconds: float = 0.0
    read_seconds: float = 0.0

    @property
    def bytes_moved(self) -> int:
        """Bytes written plus bytes read."""
        return self.bytes_written + self.bytes_read

    def __sub__(self, other: NvmeStats) -> NvmeStats:
        return NvmeStats(
            self.bytes_written - other.bytes_written,
            self.bytes_read - other.bytes_read,
            self.files_written - other.files_written,
            self.files_read - other.files_read,
            self.write_seconds - other.write_seconds,
            self.read_seconds - other.read_seconds,
        )


class _Counters:
    """The running totals behind `nvme_stats`; threads of every `NvmeIO` add to them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = NvmeStats()

    def add(
        self,
        *,
        written: int = 0,
        read: int = 0,
        files_written: int = 0,
        files_read: int = 0,
        write_seconds: float = 0.0,
        read_seconds: float = 0.0,
    ) -> None:
        with self._lock:
            now = self._now
            self._now = NvmeStats(
                now.bytes_written + written,
                now.bytes_read + read,
                now.files_written + files_written,
                now.files_read + files_read,
                now.write_seconds + write_seconds,
                now.read_seconds + read_seconds,
            )

    def snapshot(self) -> NvmeStats:
        with self._lock:
            return self._now


COUNTERS = _Counters()


def nvme_stats() -> NvmeStats:
    """zoffload's NVMe traffic in this process since it started, as a snapshot.

    ``before = zoffload.nvme_stats(); step(); moved = zoffload.nvme_stats() - before`` gives the
    bytes a step wrote to and read from offload files (see [Note: NVMe accounting]).
    """
    return COUNTERS.snapshot()
