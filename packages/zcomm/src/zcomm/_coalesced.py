"""Coalesced all-gather and reduce-scatter: many tensors, one collective, one flat buffer.

This is the unit ZeRO-3 communicates in: one collective per module, not one per parameter.
Per-call latency dominates small collectives, so packing a module's shards into one flat
buffer is what makes a model of many small parameters fast.

[Note: flat layout] A gathered flat buffer is rank-major: ``[rank 0: t0 t1 ... | rank 1: t0
t1 ... | ...]``, each rank contributing the concatenation of its shards. Output tensor i is
therefore the column block i of the buffer viewed as ``(group size, total)``; copying it out is
one strided copy per tensor (O(tensors) copies, not O(tensors x ranks)). Reduce-scatter uses
the same layout for its input, so rank r's slice of every tensor lands together.

When the caller's tensors already lie back to back in one storage (shards of a flat ZeRO
partition do), the flat buffer *is* that storage and the copy on that side is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from zcomm._checks import check_group, check_same_kind, check_tensor
from zcomm._collectives import ReduceOp, gather_flat, scatter_flat
from zcomm._handle import Handle, completed
from zcomm._world import group_size

__all__ = ["all_gather_coalesced", "reduce_scatter_coalesced"]


def _check_lists(
    op: str,
    small: Sequence[torch.Tensor],
    big: Sequence[torch.Tensor],
    names: tuple[str, str],
    size: int,
) -> None:
    given: tuple[object, object] = (small, big)  # checked at run time, whatever the annotation says
    for name, seq in zip(names, given, strict=True):
        if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence):
            raise TypeError(
                f"{op}({name}=...): expected a list of tensors, got {type(seq).__name__}"
            )
    if len(small) != len(big):
        raise ValueError(f"{op}: {names[0]} has {len(small)} tensors but {names[1]} has {len(big)}")
    if not small:
        raise ValueError(f"{op}: {names[0]} is empty")
    first = check_tensor(op, f"{names[0]}[0]", small[0])
    for i, (s, b) in enumerate(zip(small, big, strict=True)):
        check_tensor(op, f"{names[0]}[{i}]", s)
        check_tensor(op, f"{names[1]}[{i}]", b)
        check_same_kind(op, f"{names[0]}[{i}]", s, f"{names[0]}[0]", first)
        check_same_kind(op, f"{names[1]}[{i}]", b, f"{names[0]}[0]", first)
        if b.numel() != s.numel() * size:
            raise ValueError(
                f"{op}: {names[1]}[{i}] has {b.numel()} elements, expected "
                f"{names[0]}[{i}].numel() * group size = {s.numel()} * {size}"
            )
        if not b.is_contiguous():
            raise ValueError(f"{op}: {names[1]}[{i}] must be contiguous")


def _adjacent(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over `tensors` if they lie back to back in one storage, else None."""
    first = tensors[0]
    if not all(t.is_contiguous() for t in tensors):
        return None
    start, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != start or t.storage_offset() != offset:
            return None
        offset += t.numel()
    flat = first.new_empty(0)
    flat.set_(
        first.untyped_storage(), first.storage_offset(), (offset - first.storage_offset(),), (1,)
    )
    return flat


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    adjacent = _adjacent(tensors)
    return adjacent if adjacent is not None else torch.cat([t.reshape(-1) for t in tensors])


def _offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + t.numel())
    return offsets


def _copy_each(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    """The answer of either coalesced collective in a group of one: each input itself."""
    for out, inp in zip(outputs, inputs, strict=True):
        out.view(-1).copy_(inp.reshape(-1))


def all_gather_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """All-gather many tensors with one collective: ``outputs[i]`` gets every rank's ``inputs[i]``.

    Each ``outputs[i]`` holds group size times ``inputs[i].numel()`` elements, filled in rank
    order exactly as `all_gather_into_tensor` would fill it. All tensors share one dtype and
    device. With ``async_op=True`` the outputs are written when the handle is waited on.
    """
    op = "all_gather_coalesced"
    size = group_size(op, check_group(op, group))
    _check_lists(op, inputs, outputs, ("inputs", "outputs"), size)
    if size == 1:
        _copy_each(outputs, inputs)
        return completed(op)
    offsets = _offsets(inputs)
    flat_in = _flat(inputs)
    flat_out = flat_in.new_empty(size * offsets[-1])

    def copy_out() -> None:
        rows = flat_out.view(size, offsets[-1])
        for i, out in enumerate(outputs):
            out.view(size, -1).copy_(rows[:, offsets[i] : offsets[i + 1]])

    return gather_flat(op, flat_out, flat_in, group=group, async_op=async_op, then=copy_out)


def reduce_scatter_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """Reduce-scatter many tensors with one collective: ``outputs[i]`` gets this rank's chunk.

    Each ``inputs[i]`` holds group size times ``outputs[i].numel()`` elements; rank r receives
    the r-th contiguous chunk of the reduction of ``inputs[i]``, exactly as
    `reduce_scatter_tensor` would give it.
    """
    name = "reduce_scatter_coalesced"
    size = group_size(name, check_group(name, group))
    _check_lists(name, outputs, inputs, ("outputs", "inputs"), size)
    if size == 1:
        _copy_each(outputs, inputs)
        return completed(name)
    offsets = _offsets(outputs)
    flat_in = inputs[0].new_empty(size, offsets[-1])
    for i, inp in enumerate(inputs):
        flat_in[:, offsets[i] : offsets[i + 1]].copy_(inp.reshape(size, -1))
    direct = _adjacent(outputs)
    flat_out = direct if direct is not None else flat_in.new_empty(offsets[-1])

    def copy_out() -> None:
        for i, out in enumerate(outputs):
            out.view(-1).copy_(flat_out[offsets[i] : offsets[i + 1]])

    return scatter_flat(
        name,
        flat_out,
        flat_in.view(-1),
        op=op,
        group=group,
        async_op=async_op,
        size=size,
        then=None if direct is not None else copy_out,
        scratch=True,  # flat_in is this call's own copy
    )
