"""The ZeRO optimizer of one stage, with the gradient norm taken over the whole pipeline.

Each stage steps its own parameters with zengine's `ZeroOptimizer` (ZeRO 0 or 1 across the
data axis). Clipping and the fp16 overflow check need one norm for the whole model, so the
squared norm is summed over the pipeline's stages too, counting a tied weight once (on the
lowest stage that holds it). An overflow on any stage thus skips the step on every stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

import zcomm
from zengine._assembly import OptimizerFactory, ParamGroup
from zengine._optim import FlatLayout, LossScalerBase, ZeroOptimizer

__all__ = ["PipeZeroOptimizer"]


class PipeZeroOptimizer(ZeroOptimizer):
    """`ZeroOptimizer` whose global norm spans the pipeline (`pipe_group`); `copies` are the
    tied weights this stage holds as a second copy, left out of the norm."""

    layout: FlatLayout  # stages 0 and 1, reduced at the schedule's ReduceGrads

    def __init__(
        self,
        make_optimizer: OptimizerFactory,
        group_options: Sequence[ParamGroup],
        layout: FlatLayout,
        *,
        stage: int,
        group: dist.ProcessGroup | None,
        loss_scaler: LossScalerBase | None,
        clip: float,
        pipe_group: dist.ProcessGroup,
        copies: Sequence[nn.Parameter],
    ) -> None:
        """`ZeroOptimizer`'s arguments (what a pipeline sets of them), then the pipeline's."""
        super().__init__(
            make_optimizer,
            group_options,
            layout,
            stage=stage,
            group=group,
            loss_scaler=loss_scaler,
            clip=clip,
        )
        self.pipe_group = pipe_group
        self._counted = self._counted_ranges(copies)

    def _counted_ranges(self, copies: Sequence[nn.Parameter]) -> list[tuple[int, int]]:
        """The ranges of the gradient buffer that the norm sums: all but the copies."""
        total = self.partitions.grad_partitions_flat_buffer.numel()
        skipped = sorted(
            (frag.start, frag.start + frag.numel)
            for p in copies
            if (frag := self.partitions.fragments.get(id(p))) is not None and frag.numel
        )
        ranges, at = [], 0
        for start, stop in skipped:
            if start > at:
                ranges.append((at, start))
            at = max(at, stop)
        if at < total:
            ranges.append((at, total))
        return ranges

    def _norm_and_overflow(self, grads: torch.Tensor) -> tuple[float, bool]:
        norm_sq = torch.zeros((), dtype=torch.float32, device=grads.device)
        for start, stop in self._counted:
            norm_sq += torch.linalg.vector_norm(grads[start:stop], dtype=torch.float32).square()
        if self.stage > 0:  # stage 1: each data-parallel rank holds a part of the gradients
            zcomm.all_reduce(norm_sq, group=self.group)
        zcomm.all_reduce(norm_sq, group=self.pipe_group)
        value = float(norm_sq)
        return value, not math.isfinite(value)  # no second read of the device
