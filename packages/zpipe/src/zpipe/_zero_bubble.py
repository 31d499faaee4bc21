"""ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward split in two.

The input gradient (BackwardInputPass) goes upstream at once; the weight gradient
(BackwardWeightPass) waits and fills what would be bubbles in 1F1B.
"""

from __future__ import annotations

from zpipe._plan import Op
from zpipe._planned import PlannedSchedule


def zero_bubble_h1_orders(micro_batches: int, stages: int, chunks: int) -> list[list[Op]]:
    """ZB-H1's handcrafted orders. Stage i:

    - warms up with p-i forwards, as in 1F1B;
    - then runs i rounds of (I, F), deferring their weight passes: these fill the gaps where
      stage i would wait for the slower downstream stages;
    - then (I, W, F) rounds, the W of the oldest deferred micro-batch;
    - then (I, W) rounds once the forwards are done, and the deferred weight passes last.

    In-flight micro-batches (forward started, weight pass not done) never exceed p, and with
    F = I = W the makespan is 3m + p - 1 whenever m >= p.
    """
    orders = []
    for stage in range(stages):
        warmup = min(stages - stage, micro_batches)
        order: list[Op] = [("F", mb, 0) for mb in range(warmup)]
        next_forward, next_weight = warmup, 0
        for mb in range(micro_batches):
            order.append(("I", mb, 0))
            if mb >= stage:
                order.append(("W", next_weight, 0))
                next_weight += 1
            if next_forward < micro_batches:
                order.append(("F", next_forward, 0))
                next_forward += 1
        order += [("W", mb, 0) for mb in range(next_weight, micro_batches)]
        orders.append(order)
    return orders


class ZeroBubbleH1Schedule(PlannedSchedule):
    """ZB-H1: 1F1B's peak memory, a third of its bubble when F, I and W cost the same.

    Emits BackwardInputPass and BackwardWeightPass instead of BackwardPass.
    """

    @staticmethod
    def compute_orders(micro_batches: int, stages: int, chunks: int) -> list[list[Op]]:
        """See `zero_bubble_h1_orders`."""
        return zero_bubble_h1_orders(micro_batches, stages, chunks)

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__(micro_batches, stages, stage_id)
