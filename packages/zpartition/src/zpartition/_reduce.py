"""Gradients: each rank's average of the full gradients, kept as its shard's ``.grad``.

Units whose backward finished queue up and are reduce-scattered together once
``reduce_bucket_size`` elements wait (and at the end of backward), one collective per bucket
and dtype: small modules would otherwise pay a collective's latency each. The rows of a bucket
are rank-major, unit after unit, as in [Note: unit layout]. With one rank nothing moves: the
full gradient, flattened, becomes the shard's gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import zcomm
from zpartition._channel import Kind
from zpartition._param import ZeroParameter
from zpartition._unit import Unit, _GradGroup

__all__ = ["GradientSink", "keep_local", "reduce_units"]

GradientSink = Callable[[Sequence[ZeroParameter], Sequence[torch.Tensor]], None]
"""Takes reduced gradients instead of ``ds_tensor.grad``: parameters, and for each its averaged
shard gradient (1-D, ``ds_tensor.numel()`` elements, valid only during the call)."""


def keep_local(unit: Unit, sink: GradientSink | None = None) -> None:
    """One rank: move each full gradient into ``ds_tensor.grad`` (a view, no copy)."""
    for group in unit.grad_groups:
        for i in group.indices:
            p = unit.params[i]
            grad = p.grad
            if grad is None:
                continue
            p.grad = None
            if sink is not None:
                sink([p], [grad.view(-1)])
                continue
            shard = p.ds_tensor
            if shard.grad is None:
                shard.grad = grad.view(-1)
            else:
                shard.grad.add_(grad.view(-1))


def reduce_units(
    units: Sequence[Unit], sink: GradientSink | None = None, *, overlap: bool = False
) -> Callable[[], None]:
    """Average the full gradients of `units` across ranks into each rank's shard gradients
    (accumulating over backward passes) and drop the full gradients.

    Returns what finishes the job: with `overlap` the reduce-scatters are left in flight (the
    rest of backward runs meanwhile) and the returned function waits and accumulates; without,
    it is done already and the function does nothing."""
    if not units:
        return _nothing
    channel = units[0].channel
    channel.agree(Kind.REDUCE, [u.uid for u in units])
    by_dtype: dict[torch.dtype, list[tuple[Unit, _GradGroup]]] = {}
    for u in units:
        for group in u.grad_groups:
            by_dtype.setdefault(group.dtype, []).append((u, group))
    finish: _Finish = []
    for dtype, parts in by_dtype.items():
        width = sum(g.width for _, g in parts)
        rows = torch.zeros(channel.size, width, dtype=dtype, device=units[0].device)
        start = 0
        for u, group in parts:
            _fill(u, group, rows[:, start : start + group.width])
            start += group.width
        mine = rows.new_empty(width)
        handle = zcomm.reduce_scatter_tensor(
            mine, rows.view(-1), op=zcomm.ReduceOp.AVG, group=channel.group, async_op=overlap
        )
        finish.append((handle, parts, mine))
    if not overlap:
        _deliver(finish, sink)
        return _nothing
    return lambda: _deliver(finish, sink)


def _nothing() -> None:
    return None


_Finish = list[tuple[zcomm.Handle, list[tuple[Unit, _GradGroup]], torch.Tensor]]


def _deliver(finish: _Finish, sink: GradientSink | None) -> None:
    """Wait for the reduce-scatters and hand each unit its part of the result."""
    for handle, parts, mine in finish:
        handle.wait()
        start = 0
        for u, group in parts:
            reduced = mine[start : start + group.width]
            if sink is None:
                _accumulate(u, group, reduced)
            else:
                sink(
                    [u.params[i] for i in group.indices],
                    [reduced[off : off + chunk] for off, chunk in group.columns],
                )
            start += group.width


def _fill(unit: Unit, group: _GradGroup, rows: torch.Tensor) -> None:
    """Write each full gradient, padded, into its column block of `rows` (rank-major)."""
    for i, (off, chunk) in zip(group.indices, group.columns, strict=True):
        p = unit.params[i]
        grad = p.grad
        if grad is None:
            continue  # an unused parameter contributes zeros, on every rank alike
        p.grad = None
        flat, (whole, rest) = grad.reshape(-1), divmod(int(p.ds_numel), chunk)
        block = rows[:, off : off + chunk]
        block[:whole].copy_(flat[: whole * chunk].view(whole, chunk))
        if rest:
            block[whole, :rest].copy_(flat[whole * chunk :])


def _accumulate(unit: Unit, group: _GradGroup, mine: torch.Tensor) -> None:
    """Add this rank's reduced gradients to the shards' ``.grad`` (one flat tensor per group,
    viewed per parameter); a gradient set to None by ``zero_grad`` starts it over."""
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
    flat = mine.to(shards[0].device, copy=True)
    group.shard_grad = flat
    for s, (off, chunk) in zip(shards, group.columns, strict=True):
        s.grad = flat[off : off + chunk]
