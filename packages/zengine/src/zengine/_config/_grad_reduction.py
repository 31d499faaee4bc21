"""How the data-parallel reduction combines the ranks' gradients: DeepSpeed's reduction options.

[Note: gradient reduction]
By default each rank ends with the mean of the ranks' gradients (``ReduceOp.AVG``). DeepSpeed's
config has three keys that change it, which `GradReduction` holds:

- ``gradient_allreduce_op: "sum"``: the sum, divided by nothing (``prescale_gradients`` and
  ``gradient_predivide_factor`` are then ignored, as DeepSpeed ignores them);
- ``prescale_gradients: true``: the mean, divided by the ranks before the sum rather than after;
- ``gradient_predivide_factor: f``: the mean, divided by ``f`` before the sum and multiplied by
  ``f / ranks`` after it (``prescale_gradients`` wins when both are set).

That is DeepSpeed's engine (``runtime/engine.py``, ``allreduce_bucket``) and its ZeRO 1-2
all-reduce (``runtime/zero/stage_1_and_2.py``, ``gradient_reduction_w_predivide``): the gradients
are first converted to the reduction's dtype (``communication_data_type``), multiplied there,
summed, multiplied again, and only then converted back and added into the fp32 partitions; a
factor of exactly 1 is skipped. With gradient accumulation the loss is still divided by the
accumulation steps, so "sum" is the sum over ranks of each rank's mean over its micro-batches.
zengine applies the same rule at every stage, which goes beyond DeepSpeed's: its stages 2 and 3
refuse a pre-divide factor or prescaling with ``reduce_scatter`` (the default), its stage 3
refuses "sum", and its stage-3 path without ``reduce_scatter`` divides by ``f`` and by the ranks
before the sum (``stage3.py``, ``__avg_scatter_grads``): the same value up to rounding. Stages 0-2
apply the factors in zengine's gradient buckets, stage 3 in zpartition's (``reduce_scale``). A
world of one reduces nothing and scales nothing.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GradReduction"]


@dataclasses.dataclass(frozen=True)
class GradReduction:
    """DeepSpeed's reduction options, as the config sets them."""

    average: bool = True  # gradient_allreduce_op "mean"; False: "sum"
    prescale: bool = False  # prescale_gradients
    predivide: float = 1.0  # gradient_predivide_factor

    @property
    def is_mean(self) -> bool:
        """The plain mean: none of the options is set."""
        return self.average and not self.prescale and self.predivide == 1.0

    def factors(self, world: int) -> tuple[float, float] | None:
        """``(before, after)``: multiply the gradients by `before` (in the reduction's dtype),
        sum them over `world` ranks, multiply the sum by `after`. None: the plain mean
        (``ReduceOp.AVG``), which is also what a world of one gets."""
        if self.is_mean or world == 1:
            return None
        if not self.average:
            return (1.0, 1.0)
        if self.prescale:
            return (1.0 / world, 1.0)
        return (1.0 / self.predivide, self.predivide / world)
