"""DeepSpeed's logging helpers (``deepspeed.utils.logger``, ``log_dist``, ``print_dist``,
``deepspeed.runtime.utils.see_memory_usage``): messages from chosen ranks, memory at a point."""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from pathlib import Path

import zcomm
from zengine._progress import log as logger

__all__ = ["log_dist", "logger", "print_dist", "see_memory_usage"]

_GB = 1024**3


def _dist_message(message: str, ranks: Sequence[int] | None) -> str | None:
    """``[Rank r] message`` where it is to be said: everywhere without a process group; with
    one, on the ranks in `ranks` (``[-1]``: all of them; None or empty: none), as DeepSpeed's."""
    if not zcomm.is_initialized():
        return f"[Rank -1] {message}"
    rank = zcomm.get_rank()
    if ranks and (ranks[0] == -1 or rank in set(ranks)):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the given ranks (``[0]``: the first; ``[-1]``: all) through `logger`."""
    said = _dist_message(message, ranks)
    if said is not None:
        logger.log(level, said)


def print_dist(message: str, ranks: Sequence[int] | None = None) -> None:
    """`log_dist`, printed whatever the log level."""
    said = _dist_message(message, ranks)
    if said is not None:
        print(said)


def see_memory_usage(message: str, force: bool = False) -> None:
    """With `force`, print `message` and the accelerator's allocated and reserved memory (and
    their peaks, then reset) and the host's memory in use, on rank 0; without it nothing, as
    DeepSpeed's (calls left in a model cost nothing)."""
    if not force or (zcomm.is_initialized() and zcomm.get_rank() != 0):
        return
    gc.collect()  # what the collector would free is not in use
    acc = zcomm.get_accelerator()
    print(message)
    print(
        f"MA {acc.memory_allocated() / _GB:.2f} GB  Max_MA {acc.max_memory_allocated() / _GB:.2f}"
        f" GB  CA {acc.memory_reserved() / _GB:.2f} GB  Max_CA "
        f"{acc.max_memory_reserved() / _GB:.2f} GB"
    )
    host = _host_memory()
    if host is not None:
        used, percent = host
        print(f"CPU Virtual Memory:  used = {used / _GB:.2f} GB, percent = {percent:.1f}%")
    acc.reset_peak_memory_stats()


def _host_memory() -> tuple[int, float] | None:
    """(bytes in use, percent of the total) from /proc/meminfo; None where there is none."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    fields = {}
    for line in meminfo.read_text().splitlines():
        name, _, rest = line.partition(":")
        fields[name] = int(rest.split()[0]) * 1024
    total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    if not total or available is None:
        return None
    return total - available, 100.0 * (total - available) / total
