"""The ZeRO optimizer: a torch optimizer stepping each rank's flat fp32 partitions.

It holds the partitions (see [Note: flat partitions]) and the layout that fills them; a step
unscales the gradients (fp16), checks them for inf and NaN on every rank (an overflow skips the
step and lowers the loss scale, so no inf or NaN ever reaches the masters), clips them by the
global norm across ranks, steps, and writes the masters back into the parameters.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zcomm
from zengine._offload import (
    GradientSwap,
    NvmeStateSwapper,
    agree_on_swaps,
    zero_releasing_pages,
)
from zengine._optim._deepspeed_views import DeepSpeedViews
from zengine._optim._layout import Layout
from zengine._optim._layouts import ShardedLayout
from zengine._optim._loss_scaler import LossScalerBase
from zoffload import release_pages

__all__ = ["Layout", "ZeroOptimizer"]

log = logging.getLogger("zengine")


@dataclasses.dataclass(frozen=True)
class _Tile:
    """Part of a step: zpartition parameters (None: all of them) and what the optimizer steps
    for them, with their gradients."""

    params: list[nn.Parameter] | None
    stepped: list[tuple[torch.Tensor, torch.Tensor]]


def _widened(grad: torch.Tensor, factor: float) -> torch.Tensor:
    """A half-precision gradient in fp32, times `factor` (the unscale and the clip)."""
    wide = grad.float()
    return wide.mul_(factor) if factor != 1.0 else wide


class ZeroOptimizer(DeepSpeedViews):
    """What ``engine.optimizer`` is: the wrapped torch optimizer over the flat partitions.

    ``param_groups`` are the torch optimizer's (LR schedulers change them);
    ``grad_partitions_flat_buffer`` is this rank's flat fp32 gradient partition. DeepSpeed's
    attribute names (``fp16_groups``, ``averaged_gradients``, ``cur_scale``, ...) are views of
    its state (`DeepSpeedViews`).
    """

    def __init__(
        self,
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        group_options: Sequence[dict[str, Any]],
        layout: Layout,
        *,
        stage: int,
        group: dist.ProcessGroup | None,
        loss_scaler: LossScalerBase | None,
        clip: float,
        nonfinite: str = "skip",
        shard_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`group`: the data-parallel group; `shard_group`, with hybrid sharding, the ranks
        whose partitions make up the whole model (the replicas' are copies of them)."""
        self.stage = stage
        self.layout = layout
        self.partitions = layout.partitions
        self.group = group  # the data-parallel group: the ranks that train on their own data
        # the ranks whose gradient norms make up the whole: norms and overflow agree across it
        self.shard_group = shard_group if shard_group is not None else group
        self.loss_scaler = loss_scaler  # None without fp16
        self.clip = clip
        self.nonfinite = nonfinite  # without fp16: "skip" or "raise" on an inf or NaN gradient
        groups = []
        self._stepped: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its gradient)
        parts = self.partitions
        for g, (params, options) in enumerate(zip(layout.params, group_options, strict=True)):
            stepped = parts.stepped(g, params)
            for tensor, grad in stepped:
                if grad.dtype == torch.float32:
                    tensor.grad = grad  # else an fp32 copy, only during the step
                self._stepped.append((tensor, grad))
            groups.append({**options, "params": [t for t, _ in stepped]})
        self.optimizer = make_optimizer(groups)
        self._tiles = self._tiles_of(layout.tiles())
        self.global_grad_norm: float | None = None  # of the last step, before clipping
        self.skipped_steps = 0
        self.overflow = False  # whether the last step was skipped for an inf or NaN
        # stage 3: `zero_grad` was called since the last backward ([Note: zero_grad at stage 3])
        self._zero_at_backward = False
        self.swapper: NvmeStateSwapper | None = None  # offload_optimizer to NVMe, else None
        # with it and tiles: the gradients on NVMe between backward and step ([Note: gradients
        # beyond memory]); set with the swapper's first writes
        self.grad_swap: GradientSwap | None = None

    def _tiles_of(self, tiles: list[list[nn.Parameter]] | None) -> list[_Tile]:
        """[Note: tiled steps]"""
        if tiles is None:
            return [_Tile(None, self._stepped)]
        by_tensor = {id(t): (t, g) for t, g in self._stepped}
        found = []
        for params in tiles:
            keys = [self.partitions.state_key(p) for p in params]
            tensors = {id(k[0]): by_tensor[id(k[0])] for k in keys if k is not None}
            found.append(_Tile(params, list(tensors.values())))
        return found

    def tile_tensors(self) -> list[list[torch.Tensor]]:
        """What the step goes through, tile by tile: the tensors the torch optimizer steps."""
        return [[t for t, _ in tile.stepped] for tile in self._tiles]

    # -- the state on NVMe between steps (offload_optimizer) ---------------------------------

    def swap_out_states(self) -> None:
        """With NVMe offload, write the masters and the state out (after a step, at start).
        At start the masters not read from the shards yet are read a tile at a time, each
        written out before the one after the next is read (two tiles in memory at most)."""
        if self.swapper is None:
            return
        self._swap_grads()
        if self.layout.masters_unread:
            for k, tile in enumerate(self._tiles):
                self.layout.read_back(tile.params)
                self.swapper.swap_out(k)
                self.swapper.written(k - 1)
            self.layout.masters_unread = False
        self.swapper.swap_out()

    def _swap_grads(self) -> None:
        """[Note: gradients beyond memory] With the state on NVMe in tiles (stage 3, no
        replicas to all-reduce the gradients with after the backward), each tile's gradients
        go to a file of their own once final."""
        layout = self.layout
        if (
            self.grad_swap is not None
            or self.swapper is None
            or len(self._tiles) < 2
            or not isinstance(layout, ShardedLayout)
            or layout.all_reduce_replicas is not None
        ):
            return
        buffer = self.partitions.grad_partitions_flat_buffer
        slices = []
        for tile in self._tiles:
            grads = [g for _, g in tile.stepped]
            if not grads:
                return
            lo = min(g.storage_offset() for g in grads) - buffer.storage_offset()
            hi = max(g.storage_offset() + g.numel() for g in grads) - buffer.storage_offset()
            if hi - lo != sum(g.numel() for g in grads):
                return  # not one run of the buffer: the gradients stay in memory
            slices.append(buffer[lo:hi])
        self.grad_swap = layout.grad_swap = GradientSwap(self.swapper.path, slices)

    def _masters_read(self) -> None:
        """The masters read from the shards, if they were left for the swapper (which was
        never set: then all at once)."""
        if self.layout.masters_unread:
            self.layout.read_back()

    def prefetch_states(self) -> None:
        """With NVMe offload, start reading the state of the step's first tile back (at the
        boundary's backward)."""
        if self.swapper is not None:
            self.swapper.prefetch(0)

    def resident(self) -> ZeroOptimizer:
        """The masters, the state and the shards in memory (read back from NVMe if they were
        out); they stay in until the next step writes them out again."""
        if self.swapper is not None:
            self.swapper.swap_in()
        if self.grad_swap is not None:
            self.grad_swap.fetch_all()  # in memory until the step (they are read here)
        self._masters_read()
        self.layout.before_step()  # offload_param to NVMe: the shards (masters, if aliased)
        return self

    def refresh_fp32_params(self) -> None:
        """Take the model's parameters into the fp32 masters (DeepSpeed's): after weights
        were changed outside a step (``load_state_dict`` into the module, a
        ``GatheredParameters`` block with a modifier rank), the next step starts from them
        instead of overwriting them with the old masters. Every rank must call it."""
        self.resident()
        self.layout.read_back()

    # -- what DeepSpeed's ZeRO optimizers expose -------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict[Any, Any]:
        return self.optimizer.state

    @property
    def grad_partitions_flat_buffer(self) -> torch.Tensor:
        return self.partitions.grad_partitions_flat_buffer

    def stepped_tensors(self) -> list[torch.Tensor]:
        """What the torch optimizer steps: flat fp32 masters, or the fp32 shards themselves."""
        return [tensor for tensor, _ in self._stepped]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients: at stages 0-2 now (`clear_grads`), at stage 3 as the next
        backward begins, as DeepSpeed's stage 3 does.

        [Note: zero_grad at stage 3]
        DeepSpeed's stage-3 ``zero_grad`` leaves the reduced gradient partitions as they are
        and makes the next backward overwrite them, so a step called after it still steps
        with them (its ``TestZero3ParamPartitioningBase::test_zero_grad`` relies on it); a
        backward after it starts from zero all the same. The engine's own step clears the
        gradients at once."""
        if isinstance(self.layout, ShardedLayout):
            self._zero_at_backward = True
        else:
            self.clear_grads()

    def clear_grads(self) -> None:
        """Zero the gradient partitions now (they are buffers, never set to None; a large one
        on CPU hands its pages back until the next backward writes them, as freed gradients
        would be), and drop what backward passes before the boundary summed."""
        self._zero_at_backward = False
        if self.grad_swap is not None:
            self.grad_swap.forget()  # zeros in memory are what they hold now
            # pages handed back whatever the size: the gradients are a few tiles at most
            release_pages(self.partitions.grad_partitions_flat_buffer)
        else:
            zero_releasing_pages(self.partitions.grad_partitions_flat_buffer)
        self.layout.discard_accumulated()

    def before_backward(self, boundary: bool) -> None:
        """A backward begins (`boundary`: one that reduces): gradients a `zero_grad` at stage
        3 let stand are forgotten first."""
        if self._zero_at_backward:
            self.clear_grads()
        self.layout.before_backward(boundary)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> bool:
        """Step the masters and write them back; False when an overflow skipped the step."""
        # a swap file that failed on any rank raises here on every rank, the state intact
        agree_on_swaps([self.swapper, getattr(self.layout, "shard_store", None)], self.group)
        grads = self.partitions.grad_partitions_flat_buffer
        scale = self.cur_scale
        norm_sq, overflow = self._norm_and_overflow(grads)
        self.overflow = overflow
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(overflow)
        if overflow and self.loss_scaler is None and self.nonfinite == "raise":
            self.clear_grads()
            raise FloatingPointError(
                "zengine: a gradient holds an inf or NaN (the global gradient norm is not "
                "finite, on some rank); the step was not taken and the gradients are zeroed "
                "(config nonfinite_gradients is 'raise'; 'skip' would skip the step)"
            )
        if overflow:
            self.skipped_steps += 1
            self.global_grad_norm = None
            log.info(
                "zengine: gradient overflow, step skipped; loss scale %s -> %s",
                scale,
                self.cur_scale,
            )
            self.clear_grads()
            return False
        norm = math.sqrt(norm_sq) / scale
        self.global_grad_norm = norm
        factor = 1.0 / scale
        if self.clip > 0 and norm > self.clip:
            factor *= self.clip / (norm + 1e-6)
        low = grads.dtype != torch.float32
        swapped = self.grad_swap is not None and self.grad_swap.any_away
        if factor != 1.0 and not low and not swapped:
            grads.mul_(factor)  # with gradients on NVMe: tile by tile, in `_step_tiles`
        # half-precision gradients are unscaled once widened, as DeepSpeed's stage 3 does: in
        # fp16, those under 2**-14 once unscaled would lose bits as subnormals
        self._step_tiles(low=low, factor=factor)
        self.clear_grads()
        return True

    def _step_tiles(self, *, low: bool, factor: float = 1.0) -> None:
        """[Note: tiled steps]
        The torch optimizer steps a few parameters' masters at a time (``sub_group_size``
        shard elements, whole zpartition units; DeepSpeed's sub-groups): the others have no
        ``.grad`` while it runs, which every torch optimizer skips. With the state on NVMe only
        the tile being stepped, the next one (read ahead) and the last one (being written; the
        one before it is waited for) are in memory, not every master and all the state at
        once; with offload_param to NVMe, only the tile's shards are written back after it (and
        the shards are not held through the backward before the step). A step is the same
        computation whatever the tiles (each tensor is updated on its own), so the losses do
        not depend on ``sub_group_size``. One tile (the default 1e9 elements, or stages 0-2) is
        the whole step at once."""
        swapper, tiles = self.swapper, self._tiles
        grad_swap = self.grad_swap
        if grad_swap is not None and not grad_swap.any_away:
            grad_swap = None  # the gradients are in memory: nothing to read
        scale_here = grad_swap is not None and not low and factor != 1.0  # see `step`
        if swapper is None:
            self._masters_read()
        regrad = low or len(tiles) > 1  # else every fp32 gradient stays attached throughout
        if regrad:
            for tensor, _ in self._stepped:
                tensor.grad = None  # each tile attaches its own gradients while it steps
        for k, tile in enumerate(tiles):
            if grad_swap is not None:
                grad_swap.fetch(k)
                grad_swap.prefetch(k + 1)
            if swapper is not None:
                swapper.swap_in(k)
                swapper.prefetch(k + 1)
            self.layout.before_step(tile.params)
            if regrad:
                for tensor, grad in tile.stepped:
                    if scale_here:
                        grad.mul_(factor)
                    tensor.grad = _widened(grad, factor) if low else grad
            self.optimizer.step()
            if regrad:
                for tensor, _ in tile.stepped:
                    tensor.grad = None
            if grad_swap is not None:
                grad_swap.release(k)  # stepped: its gradients' pages go back
            self.layout.write_back(tile.params)
            if swapper is not None:
                swapper.swap_out(k)
                swapper.written(k - 1)  # at most three tiles in memory: k-1's write is done
        if regrad and not low:
            for tensor, grad in self._stepped:  # fp32 gradients stay attached between steps
                tensor.grad = grad
        self.layout.after_step()

    def _norm_and_overflow(self, grads: torch.Tensor) -> tuple[float, bool]:
        """The squared global gradient norm (of the scaled gradients) and whether any rank
        holds an inf or NaN: one pass over the gradients (an inf or NaN anywhere makes the
        norm one), one all-reduce. Summed in float64, so that the order of the sum does not
        show in the clipping factor (a float): gradients on NVMe are summed tile by tile as
        they go out ([Note: gradients beyond memory]), and the step is the same as with the
        gradients in memory."""
        if self.grad_swap is not None and self.grad_swap.any_away:
            norm_sq = self.grad_swap.norm_sq()  # tiles on NVMe: from the norms noted
        else:
            norm_sq = torch.linalg.vector_norm(grads, dtype=torch.float64).square()
        if self.stage > 0:  # stage 0 ranks hold the same averaged gradients: nothing to sum
            zcomm.all_reduce(norm_sq, group=self.shard_group)
        value = float(norm_sq)
        return value, not math.isfinite(value)

    def destroy(self) -> None:
        """Drop the state and the flat buffers (the engine is done with them)."""
        self.resident()  # no write or read of it still in flight
        self.swapper = None
        if self.grad_swap is not None:
            self.grad_swap.close()
            self.grad_swap = None
        self.optimizer.state.clear()
        empty = torch.empty(0)
        self.partitions.fp32_partitions_flat = None
        self.partitions.grad_partitions_flat_buffer = empty
        self.partitions.masters.clear()
        self.partitions.grads.clear()
        self._stepped.clear()

    def state_dict(self) -> dict[str, Any]:
        self.resident()
        return {"optimizer": self.optimizer.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resident()
        self.optimizer.load_state_dict(state["optimizer"])
        self.skipped_steps = state.get("skipped_steps", 0)
