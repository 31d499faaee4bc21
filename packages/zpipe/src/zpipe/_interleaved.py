"""Interleaved 1F1B (Megatron's virtual pipeline): each stage holds several model chunks."""

from __future__ import annotations

from zpipe._base import check_positive
from zpipe._plan import Op
from zpipe._planned import PlannedSchedule


def interleaved_orders(micro_batches: int, stages: int, chunks: int) -> list[list[Op]]:
    """Warm-up forwards, then one forward and one backward in turn, then the remaining backwards.

    Forwards go in groups of `stages` micro-batches, chunk by chunk; stage r warms up with
    2(p-r-1) + (v-1)p forwards (Megatron's count), so the first backward can run on the last
    stage as soon as it is reached. When `stages` does not divide the micro-batch count, the
    orders are built for the next multiple and the missing micro-batches left out: removing
    computations from a feasible order cannot make it deadlock, so any count works.
    """
    padded = -(-micro_batches // stages) * stages
    forwards = [
        (mb, chunk)
        for first in range(0, padded, stages)
        for chunk in range(chunks)
        for mb in range(first, first + stages)
    ]
    backwards = [(mb, chunks - 1 - chunk) for mb, chunk in forwards]
    total = len(forwards)
    orders = []
    for stage in range(stages):
        warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
        order: list[Op] = [("F", mb, c) for mb, c in forwards[:warmup]]
        for i in range(total - warmup):
            order.append(("F", *forwards[warmup + i]))
            order.append(("B", *backwards[i]))
        order += [("B", mb, c) for mb, c in backwards[total - warmup :]]
        orders.append([op for op in order if op[1] < micro_batches])
    return orders


class Interleaved1F1BSchedule(PlannedSchedule):
    """Interleaved 1F1B (Narayanan et al. 2021): `chunks` model chunks per stage.

    Chunk c of stage s is virtual stage c * stages + s. The bubble shrinks to
    (p-1)/(v*m+p-1) for v chunks at the price of v times the point-to-point messages.
    Works for any number of micro-batches; the closed form holds when `stages` divides it.
    """

    @staticmethod
    def compute_orders(micro_batches: int, stages: int, chunks: int) -> list[list[Op]]:
        """See `interleaved_orders`."""
        return interleaved_orders(micro_batches, stages, chunks)

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 2) -> None:
        check_positive("chunks", chunks)
        super().__init__(micro_batches, stages, stage_id, chunks=chunks)
