"""Gradients: each rank's average of the full gradients, kept as its shard's ``.grad``.

A unit whose backward finished copies its gradients into a bucket (`GradBucket`, one per
dtype, ``reduce_bucket_size`` elements at most) and drops the full ones; a full bucket is
reduce-scattered in one collective, as is what is left at the end of backward: small modules
would otherwise pay a collective's latency each. The rows of a bucket are rank-major, unit after
unit, as in [Note: unit layout]. With one rank nothing moves: the full gradient, flattened,
becomes the shard's gradient. With replicas, what a bucket's reduce-scatter leaves is held for
their all-reduce instead ([Note: hybrid sharding], `_hybrid.py`).

[Note: gradient sync]
A backward run without gradient sync (`Partitioned.set_requires_gradient_sync(False)`, FSDP2's
switch; zengine's ``coalesce_grad_reduction()``) reduces nothing: `hold` keeps
each unit's full gradients, summed over such passes in the reduction dtype, keyed by parameter.
The next backward with sync adds them to its own as its buckets are filled (`_fill`), and reduces
the held gradients of units it computed nothing for at its end, in model order, so the ranks'
buckets pair up; `Partitioned.sync_gradients` does the same outside a backward. An accumulation
then moves its gradients across the ranks once, at its end, for a full gradient's memory per
rank: nothing crosses a node in between, however the world is sharded. With one rank nothing is
reduced anyway, and the switch changes nothing. zengine buckets the gradients
of stages 0-2 on its own (`zengine/_optim/_grad_buckets.py`): why the two differ is in
ARCHITECTURE.md, "Two gradient buckets, on purpose".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

import zcomm
from zpartition._channel import Channel, Kind
from zpartition._param import ZeroParameter
from zpartition._stored_codes import quantization_block
from zpartition._unit import Unit, _GradGroup

__all__ = [
    "Deliver",
    "GradBucket",
    "GradientSink",
    "accumulate",
    "hold",
    "keep_local",
    "reduction_dtype",
    "to_sink",
]

GradientSink = Callable[[Sequence[ZeroParameter], Sequence[torch.Tensor]], None]
"""Takes reduced gradients instead of ``ds_tensor.grad``: parameters, and for each its averaged
shard gradient (1-D, ``ds_tensor.numel()`` elements, valid only during the call). A unit's
gradient group is handed over as one tuple of parameters, the same object every time, which a
sink may key what it looks up on."""

Deliver = Callable[[Unit, _GradGroup, torch.Tensor], None]
"""Where a gradient group's reduced shard gradient (one flat tensor, in the reduction's dtype,
valid only during the call) goes: the shards' ``.grad`` (`accumulate`), a sink (`to_sink`), or
the replicas' reduction ([Note: hybrid sharding])."""


def reduction_dtype(group: _GradGroup, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `group`'s gradients are reduced in: a parameter's ``comm_dtype`` first
    (autocast's lower-precision-safe modules), then the config's ``reduce_dtype``, then its
    own."""
    return group.comm or reduce_dtype or group.dtype


def to_sink(sink: GradientSink) -> Deliver:
    """Hand a group's reduced gradient to `sink`, one view per parameter."""

    def deliver(unit: Unit, group: _GradGroup, reduced: torch.Tensor) -> None:
        sink(group.params, [reduced[off : off + chunk] for off, chunk in group.columns])

    return deliver


def _taken_grads(unit: Unit) -> Iterator[tuple[_GradGroup, ZeroParameter, torch.Tensor]]:
    """Each of `unit`'s full gradients with its group and parameter, taken off the parameter
    (its ``.grad`` is None after); parameters without one are skipped."""
    for group in unit.grad_groups:
        for i in group.indices:
            p = unit.params[i]
            grad = p.grad
            if grad is not None:
                p.grad = None
                yield group, p, grad


def keep_local(unit: Unit, sink: GradientSink | None = None) -> None:
    """One rank: move each full gradient into ``ds_tensor.grad`` (a view, no copy), or hand
    each gradient group's to `sink` at once."""
    if sink is None:
        for _, p, grad in _taken_grads(unit):
            shard = p.ds_tensor
            if shard.grad is None:
                shard.grad = grad.view(-1)
            else:
                shard.grad.add_(grad.view(-1))
        return
    for group in unit.grad_groups:
        params = group.params
        taken = [(p, p.grad) for p in params]
        grads = [grad.view(-1) for _, grad in taken if grad is not None]
        for p in params:
            p.grad = None
        if len(grads) == len(params):
            sink(params, grads)
        else:  # some got no gradient: the others one by one
            for p, got in taken:
                if got is not None:
                    sink([p], [got.view(-1)])


class GradBucket:
    """Gradients of one dtype waiting to be reduce-scattered together, rank-major.

    A unit's gradients are copied in as soon as its backward is over, and the full gradients
    are dropped then: the bucket is the only full-size gradient storage, never twice over.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        capacity: int,
        channel: Channel,
        device: torch.device,
        rows: torch.Tensor | None = None,
        scale: tuple[float, float] | None = None,
        node_split: tuple[dist.ProcessGroup, int, int] | None = None,
        quantize: tuple[int, bool] | None = None,
    ) -> None:
        self.channel = channel
        self.scale = scale  # (before, after) a sum (ZeroParamConfig.reduce_scale); None: average
        # node-local accumulation: (this node's group, nodes, local rank), reduced within the
        # node only ([Note: node-local accumulation], `_partial.py`)
        self.node_split = node_split
        # quantized gradients (ZeRO++'s qgZ): (block size, hierarchical over the nodes)
        self.quantize = quantize
        # `rows`: a buffer kept across passes (persistent_grad_buckets), else a new one
        self.rows = (
            torch.empty(channel.size, capacity, dtype=dtype, device=device)
            if rows is None
            else rows
        )
        self.used = 0  # columns filled
        self.entries: list[tuple[Unit, _GradGroup, int]] = []  # (unit, group, first column)

    def fits(self, group: _GradGroup) -> bool:
        return self.used + group.width <= self.rows.shape[1]

    def add(self, unit: Unit, group: _GradGroup, held: dict[int, torch.Tensor]) -> None:
        """Copy `unit`'s gradients of this dtype in, with those `held` for them (see `hold`),
        and padding and missing ones as zeros."""
        _fill(unit, group, self.rows[:, self.used : self.used + group.width], held)
        self.entries.append((unit, group, self.used))
        self.used += group.width

    def reduce(self, deliver: Deliver, *, overlap: bool) -> Callable[[], None]:
        """Agree with the other ranks, then reduce-scatter; returns what finishes the job and
        hands each group's result to `deliver` (with `overlap` the collective is in flight
        until it is called)."""
        self.channel.agree(Kind.REDUCE, [u.uid for u, _, _ in self.entries])
        rows = self.rows if self.used == self.rows.shape[1] else self.rows[:, : self.used]
        group, used = self.channel.group, self.used
        if self.node_split is None:
            flat = rows.contiguous().view(-1)  # a copy only for a bucket left part-full
            # the bucket is not read again: reduced in place, this rank's chunk is the result
            mine = flat[self.channel.rank * used :][:used]
            result = mine
        else:
            # rows node-minor: this node's reduce-scatter gives local rank l the rows of the
            # world ranks n * L + l, one per node n
            group, nodes, local = self.node_split
            flat = rows.reshape(nodes, -1, used).transpose(0, 1).contiguous().view(-1)
            mine = flat[local * nodes * used :][: nodes * used]
            result = mine.view(nodes, used)
        scale, op = self.scale, zcomm.ReduceOp.AVG
        if scale is not None:
            op = zcomm.ReduceOp.SUM
            if scale[0] != 1.0:
                flat.mul_(scale[0])  # in the bucket's dtype, the reduction's
        if self.quantize is None:
            handle = zcomm.reduce_scatter_tensor(
                mine, flat, op=op, group=group, async_op=overlap, scratch_input=True
            )
        else:
            block, hierarchical = self.quantize
            handle = zcomm.reduce_scatter_quantized(
                mine,
                flat,
                block_size=quantization_block(block, mine.numel()),  # a small chunk: one block
                op=op,
                group=group,
                hierarchical=hierarchical,
                async_op=overlap,
            )
        entries = self.entries
        self.entries, self.rows = [], self.rows[:, :0]

        def finish() -> None:
            handle.wait()
            if scale is not None and scale[1] != 1.0:
                mine.mul_(scale[1])
            for unit, grads, start in entries:
                deliver(unit, grads, result[..., start : start + grads.width])

        if not overlap:
            finish()
            return _nothing
        return finish


def _nothing() -> None:
    return None


def hold(unit: Unit, held: dict[int, torch.Tensor], reduce_dtype: torch.dtype | None) -> None:
    """A backward without gradient sync: add `unit`'s full gradients into `held` (by ``id`` of
    the parameter, in the reduction dtype) instead of reducing them ([Note: gradient sync])."""
    for group, p, grad in _taken_grads(unit):
        mine = held.get(id(p))
        if mine is None:
            # autograd's tensor, let go: kept without a copy where it has the dtype
            held[id(p)] = grad.to(reduction_dtype(group, reduce_dtype))
        else:
            mine.add_(grad)


def _fill(unit: Unit, group: _GradGroup, rows: torch.Tensor, held: dict[int, torch.Tensor]) -> None:
    """Write each full gradient, with what is `held` for it, padded, into its column block of
    `rows` (rank-major). The common case, a gradient filling its W rows exactly, is one view
    of it per parameter and one copy for all."""
    dsts, srcs = [], []
    ranks = rows.shape[0]
    split = group.row_split
    for p, (off, chunk), (whole, rest) in zip(group.params, group.columns, split, strict=True):
        grad = p.grad
        if held:  # backward passes without gradient sync held some ([Note: gradient sync])
            earlier = held.pop(id(p), None)
            if earlier is not None:
                grad = earlier if grad is None else earlier.add_(grad)
        block = rows[:, off : off + chunk]
        if grad is None:
            block.zero_()  # an unused parameter contributes zeros, on every rank alike
            continue
        p.grad = None
        if whole == ranks:
            dsts.append(block)
            srcs.append(grad.reshape(whole, chunk))
            continue
        flat = grad.reshape(-1)
        block[:whole].copy_(flat[: whole * chunk].view(whole, chunk))
        block[whole:].zero_()  # the padding of the last rank's chunk
        if rest:
            block[whole, :rest].copy_(flat[whole * chunk :])
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def accumulate(unit: Unit, group: _GradGroup, mine: torch.Tensor, *, adopt: bool = False) -> None:
    """Add this rank's reduced gradients to the shards' ``.grad`` (one flat tensor per group,
    viewed per parameter); a gradient set to None by ``zero_grad`` starts it over, from a copy
    of `mine`, or (`adopt`: the caller lets it go) from `mine` itself where its dtype and
    device are the shards'."""
    shards = [unit.params[i].ds_tensor for i in group.indices]
    flat = group.shard_grad
    live = flat is not None and all(
        s.grad is not None and s.grad.data_ptr() == flat[off:].data_ptr()
        for s, (off, _) in zip(shards, group.columns, strict=True)
    )
    if live:
        assert flat is not None
        flat.add_(mine.to(flat.device))
        return
    # in the shards' dtype: a gradient reduced in another (reduce_dtype) comes back as theirs
    flat = mine.to(shards[0].device, shards[0].dtype, copy=not adopt)
    group.shard_grad = flat
    for s, (off, chunk) in zip(shards, group.columns, strict=True):
        s.grad = flat[off : off + chunk]
