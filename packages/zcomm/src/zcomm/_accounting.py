"""Accounting of communication: bytes, count and time per operation, printed as a table.

Off by default. When off, the only cost on each operation is reading one module-level
boolean (`enabled()`); the recording path runs only when someone asked for the numbers.
Each operation's bytes are also counted by link class: within a node, or across nodes (its
group's ranks on several nodes; a point-to-point operation's two ranks on two).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

__all__ = [
    "CommOpStats",
    "comm_bytes_by_link",
    "comm_summary",
    "enable_comm_accounting",
    "enabled",
    "log_summary",
    "record",
    "reset_comm_accounting",
]

# The bus factor of each operation: how many of its bytes cross the slowest link of a ring,
# per rank, relative to the message size (the convention of nccl-tests, so our figures
# compare with theirs). n is the group size.
_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,  # qgZ's exchange: each rank keeps 1/n
}


@dataclass
class CommOpStats:
    """What was recorded for one operation name since the last reset."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bus_bytes: float = 0.0  # bytes scaled by the bus factor, summed per call
    intra_node_bytes: int = 0  # the part of `bytes` of calls within one node
    inter_node_bytes: int = 0  # the part of `bytes` of calls whose ranks span nodes

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth in bytes per second (message bytes over time)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def busbw(self) -> float:
        """Bus bandwidth in bytes per second (nccl-tests' convention)."""
        return self.bus_bytes / self.seconds if self.seconds > 0 else 0.0


# Module state: one recorder per process; ZCOMM_COMM_ACCOUNTING=1 turns it on at import.
_enabled = os.environ.get("ZCOMM_COMM_ACCOUNTING", "") not in ("", "0")
_stats: dict[str, CommOpStats] = {}


def enabled() -> bool:
    """Whether operations are being recorded (read on every operation: keep it trivial)."""
    return _enabled


def enable_comm_accounting(enabled: bool = True) -> None:
    """Turn recording of every collective's bytes, count and time on (or off)."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enable_comm_accounting(enabled=...): expected a bool, got {enabled!r}")
    _enabled = enabled


def reset_comm_accounting() -> None:
    """Forget everything recorded so far (recording stays on or off as it was)."""
    _stats.clear()


def record(op: str, nbytes: int, seconds: float, group_size: int, inter_node: bool) -> None:
    """Add one completed operation to the table; `inter_node`: its ranks span nodes."""
    stats = _stats.setdefault(op, CommOpStats())
    stats.count += 1
    stats.bytes += nbytes
    if inter_node:
        stats.inter_node_bytes += nbytes
    else:
        stats.intra_node_bytes += nbytes
    stats.seconds += seconds
    factor = _BUS_FACTORS.get(op)
    stats.bus_bytes += nbytes * (factor(group_size) if factor and group_size > 0 else 1.0)


def comm_summary() -> dict[str, CommOpStats]:
    """A copy of the per-operation statistics recorded so far."""
    return {op: dataclasses.replace(s) for op, s in _stats.items()}


def comm_bytes_by_link() -> dict[str, int]:
    """The bytes of every operation since the last reset by link class: ``"intra_node"``
    (a group within one node) and ``"inter_node"`` (a group across nodes)."""
    return {
        "intra_node": sum(s.intra_node_bytes for s in _stats.values()),
        "inter_node": sum(s.inter_node_bytes for s in _stats.values()),
    }


def _format_table(stats: dict[str, CommOpStats]) -> str:
    header = (
        "| op | count | total MB | intra-node MB | inter-node MB | total ms | avg ms "
        "| algbw GB/s | busbw GB/s |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for op in sorted(stats):
        s = stats[op]
        avg_ms = 1e3 * s.seconds / s.count if s.count else 0.0
        lines.append(
            f"| {op} | {s.count} | {s.bytes / 1e6:.3f} | {s.intra_node_bytes / 1e6:.3f} "
            f"| {s.inter_node_bytes / 1e6:.3f} | {1e3 * s.seconds:.3f} | {avg_ms:.3f} "
            f"| {s.algbw / 1e9:.3f} | {s.busbw / 1e9:.3f} |"
        )
    return "\n".join(lines)


def log_summary(*, show: bool = True) -> str:
    """The recorded statistics as a markdown table, one row per operation (bytes in all,
    within nodes and across nodes, time, bandwidths); printed if `show`."""
    table = _format_table(comm_summary())
    if show:
        print(table, flush=True)
    return table
