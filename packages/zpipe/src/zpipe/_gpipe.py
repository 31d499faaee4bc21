"""GPipe: every forward, then every backward (fill and drain)."""

from __future__ import annotations

from zpipe._plan import Op
from zpipe._planned import PlannedSchedule


def gpipe_orders(micro_batches: int, stages: int, chunks: int) -> list[list[Op]]:
    """All forwards in micro-batch order, then all backwards in the same order, on every stage."""
    order = [("F", mb, 0) for mb in range(micro_batches)]
    order += [("B", mb, 0) for mb in range(micro_batches)]
    return [list(order) for _ in range(stages)]


class GPipeSchedule(PlannedSchedule):
    """GPipe (Huang et al. 2019): simple, and every micro-batch's activations live at once.

    Bubble fraction (p-1)/(m+p-1); peak activations m micro-batches on every stage.
    """

    @staticmethod
    def compute_orders(micro_batches: int, stages: int, chunks: int) -> list[list[Op]]:
        """See `gpipe_orders`."""
        return gpipe_orders(micro_batches, stages, chunks)

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__(micro_batches, stages, stage_id)
