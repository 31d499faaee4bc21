"""Gradients reduced within a group of ranks and held until the accumulation's boundary, when
they are reduced across the rest of the world: hybrid sharding's replicas and node-local
accumulation.

[Note: node-local accumulation]
Plain ZeRO-3 over several nodes reduce-scatters every micro-batch's gradients across the world,
and so across the nodes. With ``ZeroParamConfig.node_local_accumulation`` a bucket is
reduce-scattered within this rank's node instead (`zcomm.intra_node_group`): with nodes of L
ranks, the local rank l gets the sum over its node of the world shards ``n * L + l`` of every
node n (the bucket's rows reordered node-minor for it, one copy), N shards where the world
reduce-scatter gives one. Those are held, summed over the micro-batches; the backward that
ends the accumulation (``set_requires_all_reduce(True)``, the default) reduce-scatters them
across the ranks with the same local rank (`zcomm.inter_node_group`), which leaves each rank
its own shard, reduced over the world: the gradients cross the nodes once per accumulation.
The cost: N shard gradients per rank (1/L of the full gradient) between micro-batches, where
plain ZeRO-3 holds one. Means compose (the mean within a node, then across nodes), and
``reduce_scale``'s factors are applied once each, as with replicas.

Both uses hold the same way (`PartialGradients`): one zeroed buffer per reduction dtype, rows x
(every trainable gradient group's columns, then one presence flag per group), made at the
first gradient held, given to the shards' ``.grad`` (or the sink) at the end. The flags are
summed with the gradients, so a parameter no rank had a gradient for keeps ``.grad`` None and a
rank that holds nothing still joins collectives of the same size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

import zcomm
from zpartition._errors import ZeroParamError
from zpartition._reduce import Deliver, reduction_dtype
from zpartition._unit import Unit, _GradGroup

__all__ = ["PartialGradients", "node_split"]


class PartialGradients:
    """One partitioned model's shard gradients reduced within a group and held until they are
    reduced across `group`: all-reduced (``rows == 1``: hybrid sharding's replicas, [Note:
    hybrid sharding]) or reduce-scattered from `rows` shards per group to one (node-local
    accumulation, [Note: node-local accumulation])."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        units: Sequence[Unit],
        reduce_dtype: torch.dtype | None,
        scale: tuple[float, float] | None,
        device: torch.device,
        rows: int = 1,
    ) -> None:
        self.group = group
        self.rows = rows
        self.after = None if scale is None else scale[1]  # None: the mean
        self.device = device
        # per dtype: (unit, group, offset) in model order; the flags follow the places
        self._places: dict[torch.dtype, list[tuple[Unit, _GradGroup, int]]] = {}
        self._widths: dict[torch.dtype, int] = {}
        self._where: dict[int, tuple[torch.dtype, int, int]] = {}  # id(group) -> dtype, offset, i
        for unit in units:
            for g in unit.grad_groups:
                dtype = reduction_dtype(g, reduce_dtype)
                places = self._places.setdefault(dtype, [])
                offset = self._widths.get(dtype, 0)
                self._where[id(g)] = (dtype, offset, len(places))
                places.append((unit, g, offset))
                self._widths[dtype] = offset + g.width
        self._held: dict[torch.dtype, torch.Tensor] = {}

    def _buffer(self, dtype: torch.dtype) -> torch.Tensor:
        held = self._held.get(dtype)
        if held is None:
            size = self._widths[dtype] + len(self._places[dtype])
            held = torch.zeros(self.rows, size, dtype=dtype, device=self.device)
            self._held[dtype] = held
        return held

    def hold(self, unit: Unit, group: _GradGroup, reduced: torch.Tensor) -> None:
        """Add a group's reduction within the first group to what is held (a `Deliver`):
        `reduced` is ``rows x group.width`` (or ``group.width`` for one row)."""
        dtype, offset, index = self._where[id(group)]
        held = self._buffer(dtype)
        held[:, offset : offset + group.width].add_(reduced.reshape(self.rows, group.width))
        held[:, self._widths[dtype] + index] = 1

    def finish(self, deliver: Deliver) -> None:
        """Reduce what is held across `group` (every dtype's buffer, zeros where this rank
        holds none, so the collectives match) and hand each present group's result to
        `deliver` (which may keep it: it is nobody else's)."""
        for dtype in sorted(self._places, key=str):
            held = self._buffer(dtype)
            if self.rows == 1:
                mine = held[0]
                zcomm.all_reduce(mine, op=self._op(), group=self.group)
            else:
                mine = torch.empty(held.shape[1], dtype=dtype, device=self.device)
                zcomm.reduce_scatter_tensor(
                    mine, held.view(-1), op=self._op(), group=self.group, scratch_input=True
                )
            self._scale_after(mine)
            width = self._widths[dtype]
            present = mine[width:].tolist()  # one device sync per dtype, not one per group
            for (unit, group, offset), flag in zip(self._places[dtype], present, strict=True):
                if flag > 0:
                    deliver(unit, group, mine[offset : offset + group.width])
        self._held.clear()  # what was delivered may be kept: the buffers are not reused

    def drop(self) -> None:
        """Forget what is held."""
        self._held.clear()

    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> None:
        """The replicas' stage of the reduction, in place: the mean, or the sum times the
        post-factor."""
        for t in tensors:
            zcomm.all_reduce(t, op=self._op(), group=self.group)
            self._scale_after(t)

    def _op(self) -> dist.ReduceOp.RedOpType:
        """The mean, or a sum the post-factor follows."""
        return zcomm.ReduceOp.AVG if self.after is None else zcomm.ReduceOp.SUM

    def _scale_after(self, t: torch.Tensor) -> None:
        if self.after is not None and self.after != 1.0:
            t.mul_(self.after)


def node_split(
    group: dist.ProcessGroup | None, replicate: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup, tuple[dist.ProcessGroup, int, int]] | None:
    """Node-local accumulation's groups for a model partitioned across `group`: ``(the ranks
    of this local rank across the nodes, (this node's ranks, nodes, local rank))``; None on
    one node, where nothing crosses one. Raises `ZeroParamError` for a model partitioned across
    less than the world, or with replicas. Every rank of the world calls it at once (the groups
    are built by all)."""
    where = "ZeroParamConfig.node_local_accumulation"
    if replicate is not None:
        raise ZeroParamError(
            f"{where}: not with hybrid sharding (a replicate group): its shard groups keep the "
            "reduce-scatters within them already, and its replicas all-reduce at the boundary"
        )
    world = dist.get_world_size()
    if group is not None and dist.get_world_size(group) != world:
        raise ZeroParamError(
            f"{where}: the model must be partitioned across the whole world of {world} ranks, "
            f"not a group of {dist.get_world_size(group)} (nodes are the world's)"
        )
    layout = zcomm.node_layout()
    if layout.nodes == 1:
        return None
    local = layout.local_rank_of(dist.get_rank())
    intra, inter = zcomm.intra_node_group(), zcomm.inter_node_group()
    return inter, (intra, layout.nodes, local)
