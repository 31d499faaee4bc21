"""`Layout`: what the optimizer, its DeepSpeed views, the engine and offload_states use of a
layout, declared apart from `ZeroOptimizer` so that the modules the optimizer imports can name
it without importing the optimizer back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from zengine._optim._partitions import Partitions

__all__ = ["Layout"]


class Layout(Protocol):
    """What the optimizer, the engine and offload_states use of a layout: `FlatLayout`
    (stages 0-2) or `ShardedLayout` (stage 3)."""

    partitions: Partitions
    # per group: the compute-dtype parameters' flat storage, the full gradients accumulated
    # over micro-batches (stages 0, 1) and one backward's in the compute dtype when those are
    # wider; empty where the layout keeps none (stage 3's parameters are zpartition's shards)
    flats: list[torch.Tensor]
    grad_flats: list[torch.Tensor]
    low_grad_flats: list[torch.Tensor]
    # the masters not read from the shards yet (stage 3 with NVMe: read a tile at a time)
    masters_unread: bool

    @property
    def params(self) -> Sequence[Sequence[nn.Parameter]]: ...

    def before_backward(self, boundary: bool) -> None: ...
    def after_backward(self, boundary: bool) -> None: ...
    def discard_accumulated(self) -> None: ...
    def hold_gradients(self, hold: bool) -> None: ...
    def reduce_held(self) -> None: ...
    def tiles(self) -> list[list[nn.Parameter]] | None: ...
    def before_step(self, params: Sequence[nn.Parameter] | None = None) -> None: ...
    def write_back(self, params: Sequence[nn.Parameter] | None = None) -> None: ...
    def read_back(self, params: Sequence[nn.Parameter] | None = None) -> None: ...
    def after_step(self) -> None: ...
    def remove(self) -> None: ...
