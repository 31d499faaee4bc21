"""DeepSpeed's names on the ZeRO optimizer: views of its state that tests and tools read.

DeepSpeed's tests, and tools written against its optimizers, read attributes of
``engine.optimizer`` (``fp16_groups``, ``averaged_gradients``, ``cur_scale``, ...). Each name
here means what it means on DeepSpeed's optimizer of the same stage, with the same shapes, and
is a view of zengine's own state, not a copy kept in step with it. DeepSpeed's names that would
need state zengine does not keep are left out (the compat package's README lists them, with
why).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zcomm
from zengine._optim._layout import Layout
from zengine._optim._layouts import ALIGNMENT, FlatLayout, ShardedLayout
from zengine._optim._loss_scaler import DynamicLossScaler, LossScalerBase
from zengine._optim._parameter_offload import ParameterOffload
from zengine._optim._partitions import Partitions

__all__ = ["DeepSpeedViews"]


class DeepSpeedViews:
    """DeepSpeed's attribute names, for `ZeroOptimizer` (a base class of it)."""

    # set by ZeroOptimizer.__init__
    stage: int
    layout: Layout
    partitions: Partitions
    group: dist.ProcessGroup | None
    shard_group: dist.ProcessGroup | None
    loss_scaler: LossScalerBase | None
    global_grad_norm: float | None

    # -- the parameters and their partitions -------------------------------------------------

    @property
    def fp16_groups(self) -> list[list[nn.Parameter]]:
        """Each optimizer group's trainable parameters, in order (DeepSpeed's stage-3 name, its
        ``bit16_groups`` at stages 1-2); at stage 3, as DeepSpeed's, each group cut into
        sub-groups where the step's tiles (``sub_group_size`` elements) cut it: with the default
        size a sub-group is the group."""
        layout = self.layout
        if isinstance(layout, ShardedLayout):
            return [list(params) for params in layout.sub_groups]
        return [list(params) for params in layout.params]

    bit16_groups = fp16_groups

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """Stage 3: per sub-group (`fp16_groups`), the flat fp32 masters of its shards, the
        tensor the torch optimizer steps (its state is keyed by it), as DeepSpeed's."""
        layout = self.layout
        if not isinstance(layout, ShardedLayout) or layout.aliased:
            why = (
                "its fp32 shards are their own masters, stepped one per parameter, so there is "
                "no flat fp32 copy (train in bf16 or fp16, or offload the optimizer, for one)"
                if isinstance(layout, ShardedLayout)
                else f"this optimizer runs ZeRO stage {self.stage}"
            )
            raise AttributeError(
                f"{type(self).__name__}.fp32_partitioned_groups_flat: DeepSpeed's ZeRO stage 3 "
                f"optimizer attribute; {why}"
            )
        return list(layout.sub_group_flats)

    @property
    def nccl_start_alignment_factor(self) -> int:
        """Stages 1 and 2: each rank's partition of a group starts on a multiple of this many
        elements (4 bytes of a 16-bit dtype); ``allgather_bucket_size`` must be one too."""
        self._flat_partitions("nccl_start_alignment_factor")
        return ALIGNMENT

    @property
    def parallel_partitioned_bit16_groups(self) -> list[list[torch.Tensor]]:
        """Stages 1 and 2: per group, every rank's partition of the parameters' flat buffer (in
        the compute dtype), in rank order: views of the storage the parameters are views of."""
        layout = self._flat_partitions("parallel_partitioned_bit16_groups")
        return [
            list(flat.view(layout.world, -1).unbind(0)) if flat.numel() else []
            for flat in layout.flats
        ]

    parallel_partitioned_fp16_groups = parallel_partitioned_bit16_groups  # DeepSpeed's old name

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        """Per group, this rank's fp32 master partition, flat (stages 0-2)."""
        return self.partitions.masters

    @property
    def fp32_groups_flat(self) -> list[torch.Tensor]:
        """Stage 0 in fp16 or bf16: per group, the flat fp32 masters of all its parameters
        (DeepSpeed's ``FP16_Optimizer``, which steps them)."""
        layout = self.layout
        if self.stage != 0 or not isinstance(layout, FlatLayout) or layout.aliased:
            raise AttributeError(
                f"{type(self).__name__}.fp32_groups_flat: DeepSpeed's fp16/bf16 optimizer "
                f"attribute without ZeRO; this optimizer runs ZeRO stage {self.stage}"
                + (" in fp32, whose parameters are their own masters" if self.stage == 0 else "")
            )
        return self.partitions.masters

    # -- the gradients -----------------------------------------------------------------------

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """Per group, this rank's reduced gradient partition (one flat tensor)."""
        return {g: [grad] for g, grad in enumerate(self.partitions.grads)}

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """``{group: {index in the group: gradient}}``, each this rank's piece of a
        parameter's reduced gradient in fp32 (DeepSpeed's stage-3 method): at stage 3 its
        shard's, ``ceil(numel / ranks)`` elements, zero past the parameter's end on the last
        ranks; at stages 0-2 the part of the parameter in this rank's partition (possibly
        empty). A view of the gradient partitions when they are fp32, else an fp32 copy."""
        found: dict[int, dict[int, torch.Tensor]] = {}
        for g, params in enumerate(self.layout.params):
            for i, p in enumerate(params):
                grad = self.partitions.grad_of(p)
                if grad is not None:
                    found.setdefault(g, {})[i] = grad.float()
        return found

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """Per group, the norm of its reduced gradients over every rank (of the loss-scaled
        gradients with fp16, as DeepSpeed's before its step unscales them). Every rank of the
        data-parallel group must call it."""
        grads = self.partitions.grads
        if not grads:
            return []
        squares = torch.stack(
            [torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in grads]
        )
        if self.stage > 0:  # stage 0 ranks hold the same averaged gradients: nothing to sum
            zcomm.all_reduce(squares, group=self.shard_group)
        return list(squares.sqrt().unbind(0))

    @property
    def _global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (DeepSpeed's name for
        ``global_grad_norm``; None before the first step and after a skipped one)."""
        return self.global_grad_norm

    # -- the hooks ----------------------------------------------------------------------------

    @property
    def parameter_offload(self) -> ParameterOffload:
        """Stage 3: DeepSpeed's owner of the modules' hooks, as TRL's generation takes them off
        and puts them back (`ParameterOffload`). Other stages have none, as DeepSpeed's."""
        layout = self.layout
        partitioned = layout.model if isinstance(layout, ShardedLayout) else None
        if partitioned is None:
            raise AttributeError(
                f"{type(self).__name__}.parameter_offload: DeepSpeed's ZeRO stage 3 attribute; "
                f"this optimizer runs ZeRO stage {self.stage}"
            )
        found = self.__dict__.get("_parameter_offload")
        if found is None:  # one object: tools assign its hook lists
            found = self.__dict__["_parameter_offload"] = ParameterOffload(partitioned)
        return found

    # -- fp16 loss scaling -------------------------------------------------------------------

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    @property
    def loss_scale(self) -> float:
        """DeepSpeed's other name for `cur_scale` (1.0 without fp16's loss scaling)."""
        return self.cur_scale

    @property
    def _dynamic(self) -> DynamicLossScaler | None:
        scaler = self.loss_scaler
        return scaler if isinstance(scaler, DynamicLossScaler) else None

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale adapts to overflows (fp16 with ``loss_scale`` 0)."""
        return self._dynamic is not None

    @property
    def scale_window(self) -> int | None:
        """Steps without an overflow before a dynamic scale grows (None: not dynamic)."""
        return self._dynamic.scale_window if self._dynamic is not None else None

    @property
    def min_loss_scale(self) -> float | None:
        """The smallest dynamic loss scale (None: not dynamic)."""
        return self._dynamic.min_scale if self._dynamic is not None else None

    @property
    def cur_iter(self) -> int:
        """Steps the dynamic loss scaler has counted (0 without one)."""
        return self._dynamic.cur_iter if self._dynamic is not None else 0

    @property
    def loss_scale_config(self) -> DeepSpeedViews:
        """Where DeepSpeed 0.18 and later keep the fp16 scale's state (``cur_scale``,
        ``cur_iter``, ``scale_window``, ``min_loss_scale``, ``dynamic_loss_scale``): here the
        optimizer itself, which answers to the same names."""
        return self

    # -- helpers ---------------------------------------------------------------------------

    def _flat_partitions(self, name: str) -> FlatLayout:
        """The layout of stages 1 and 2, whose flat partitions `name` describes; other stages
        have no such attribute (DeepSpeed's optimizers there have none either)."""
        layout = self.layout
        if not isinstance(layout, FlatLayout) or layout.stage not in (1, 2):
            raise AttributeError(
                f"{type(self).__name__}.{name}: DeepSpeed's ZeRO stage 1-2 optimizer attribute; "
                f"this optimizer runs ZeRO stage {self.stage}"
            )
        return layout
