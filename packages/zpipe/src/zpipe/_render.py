"""Text timelines of a simulated schedule: one row per stage."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zpipe._simulate import Interval

IDLE = "."


def _label(interval: Interval, chunks: int) -> str:
    micro_batch = "?" if interval.micro_batch is None else str(interval.micro_batch)
    chunk = chr(ord("a") + interval.chunk % 26) if chunks > 1 else ""
    return f"{interval.kind}{micro_batch}{chunk}"


def _full(
    timeline: Sequence[Sequence[Interval]], makespan: float, chunks: int
) -> tuple[list[str], float]:
    """Every computation labelled, e.g. `F3` or `B3a` (chunk a), in cells of equal time."""
    durations = [iv.end - iv.start for row in timeline for iv in row if iv.end > iv.start]
    unit = min(durations, default=1.0)
    cell = 1 + max((len(_label(iv, chunks)) for row in timeline for iv in row), default=1)
    scale = cell / unit  # characters per unit of time
    rows = []
    for row in timeline:
        chars = [IDLE] * math.ceil(makespan * scale - 1e-9)
        for iv in row:
            begin, end = round(iv.start * scale), round(iv.end * scale)
            text = _label(iv, chunks).ljust(end - begin)[: end - begin]
            chars[begin:end] = text
        rows.append("".join(chars))
    return rows, 1 / scale


def _compact(
    timeline: Sequence[Sequence[Interval]], makespan: float, width: int
) -> tuple[list[str], float]:
    """One character per slice of time: the kind running at its middle (lower case: odd chunk)."""
    step = makespan / width
    rows = []
    for row in timeline:
        chars, index = [], 0
        for column in range(width):
            middle = (column + 0.5) * step
            while index < len(row) and row[index].end <= middle:
                index += 1
            iv = row[index] if index < len(row) and row[index].start <= middle else None
            if iv is None:
                chars.append(IDLE)
            else:
                chars.append(iv.kind.lower() if iv.chunk % 2 else iv.kind)
        rows.append("".join(chars))
    return rows, step


def render_timeline(
    timeline: Sequence[Sequence[Interval]],
    makespan: float,
    chunks: int,
    *,
    width: int | None = None,
) -> str:
    """Rows `stage N |...`: F forward, B backward, I input gradient, W weight gradient, . idle.

    Each computation is labelled with its micro-batch (and chunk letter a, b, ... when stages
    hold several chunks). When `width` is given and the labelled timeline is wider, each
    character shows the kind running in one slice of time instead.
    """
    if makespan <= 0:
        return "(nothing to show: the schedule does no computation)"
    rows, per_char = _full(timeline, makespan, chunks)
    if width is not None and max(map(len, rows), default=0) > width:
        rows, per_char = _compact(timeline, makespan, width)
    name_width = len(str(len(rows) - 1))
    lines = [f"stage {s:>{name_width}} |{row}|" for s, row in enumerate(rows)]
    lines.append(f"one character = {per_char:g} time units; '{IDLE}' idle")
    return "\n".join(lines)
