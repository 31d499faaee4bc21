"""ZeRO++'s quantized collectives: qwZ's all-gather of weights and qgZ's reduce-scatter of
gradients, whose wire carries int8 or int4 codes and float32 block scales (`quantize`)
instead of the tensors themselves, about 1/4 or 1/8 of fp32's bytes.

They are built from zcomm's own collectives (`all_gather_into_tensor`, `all_to_all_single`),
so the accounting records the bytes actually moved, under those names and by link class, as
for any other call; `quantized_collective_nbytes` gives those bytes. Each rank's codes and
scales travel packed in one uint8 buffer per peer: one collective per stage, not two.

A non-finite value cannot be quantized (`quantize` raises); here its block is sent with a NaN
scale instead, so that it arrives as NaN on every rank (overflow checks downstream still see
it) and no rank is left waiting in a collective that another one abandoned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from zcomm._checks import check_group, check_tensor
from zcomm._collectives import ReduceOp, all_gather_into_tensor, all_to_all_single
from zcomm._handle import Handle, completed
from zcomm._nodes import inter_node_group, intra_node_group, node_layout
from zcomm._quantize import (
    QuantizationError,
    Quantized,
    _blocks,
    _check_format,
    dequantize,
    quantize,
    quantized_nbytes,
)
from zcomm._world import group_size

__all__ = ["all_gather_quantized", "quantized_collective_nbytes", "reduce_scatter_quantized"]

_OPS = ("all_gather_quantized", "reduce_scatter_quantized")


class _Then(Handle):
    """The handle of a zcomm operation in flight, and what runs once its data has arrived."""

    __slots__ = ("_inner", "_keep")

    def __init__(
        self,
        op: str,
        group: dist.ProcessGroup | None,
        inner: Handle,
        then: Callable[[], None],
        keep: torch.Tensor,
    ) -> None:
        super().__init__(op, group, None, finish=then)  # no bytes: `inner` records its own
        self._inner = inner
        self._keep: torch.Tensor | None = keep  # the buffer sent: alive until the data arrived

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            try:
                self._inner.wait(timeout)
            except BaseException:
                self._done = True  # as a failed Handle: later waits do not retry
                raise
            finally:
                self._keep = None
            self._complete()
        return True


def _then(
    op: str,
    group: dist.ProcessGroup | None,
    inner: Handle,
    then: Callable[[], None],
    async_op: bool,
    *,
    keep: torch.Tensor,
) -> Handle:
    """`inner`'s operation, then `then`: now, or in the handle's wait() with `async_op`."""
    if async_op:
        return _Then(op, group, inner, then, keep)
    then()  # `inner` is complete: a synchronous call
    return completed(op)


def _check_flat(op: str, name: str, value: object) -> torch.Tensor:
    tensor = check_tensor(op, name, value)
    if tensor.dim() != 1:
        raise ValueError(
            f"{op}({name}=...): expected a 1-D tensor, got shape {tuple(tensor.shape)}"
        )
    if not tensor.is_floating_point():
        raise TypeError(f"{op}({name}=...): expected a floating dtype, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}({name}=...): must be contiguous")
    return tensor


def _check_arguments(
    op: str,
    small: tuple[str, torch.Tensor],
    big: tuple[str, torch.Tensor],
    bits: int,
    block_size: int,
    group: dist.ProcessGroup | None,
) -> int:
    """Check the shard, the full tensor and the format; the group size."""
    for name, tensor in (small, big):
        _check_flat(op, name, tensor)
    try:
        _check_format(bits, block_size)
    except ValueError as error:
        raise ValueError(f"{op}: {error}") from None
    size = group_size(op, check_group(op, group))
    (small_name, s), (big_name, b) = small, big
    if s.device != b.device:
        raise ValueError(f"{op}: {small_name} is on {s.device}, but {big_name} is on {b.device}")
    if b.numel() != s.numel() * size:
        raise ValueError(
            f"{op}: {big_name} has {b.numel()} elements, expected {small_name}.numel() * group "
            f"size = {s.numel()} * {size} = {s.numel() * size}"
        )
    return size


def _quantize(
    x: torch.Tensor, bits: int, block_size: int, stochastic: bool, generator: torch.Generator | None
) -> Quantized:
    """`quantize`, but a block with NaN or inf gets a NaN scale (it dequantizes to NaN)."""
    try:
        return quantize(
            x, bits=bits, block_size=block_size, stochastic=stochastic, generator=generator
        )
    except QuantizationError:
        pass  # the rare path: the other ranks are waiting for this one's data
    flat = x.detach().reshape(-1).to(torch.float32)
    flat = torch.nn.functional.pad(
        flat, (0, _blocks(x.numel(), block_size) * block_size - x.numel())
    )
    values = flat.view(-1, block_size)
    bad = ~torch.isfinite(values).all(dim=1)
    q = quantize(
        values.masked_fill(bad.unsqueeze(1), 0.0),
        bits=bits,
        block_size=block_size,
        stochastic=stochastic,
        generator=generator,
    )
    return Quantized(
        q.data, q.scales.masked_fill(bad, float("nan")), x.numel(), bits, block_size, x.dtype
    )


def _pack(q: Quantized, rows: int) -> torch.Tensor:
    """`q`'s scales and codes as `rows` rows of bytes, one per peer: row r holds the scales,
    then the codes, of the r-th `rows`-th of q's blocks."""
    return torch.cat(
        (q.scales.view(rows, -1).view(torch.uint8), q.data.view(rows, -1).view(torch.uint8)),
        dim=1,
    )


def _rows(
    buffer: torch.Tensor, blocks: int, bits: int, block_size: int, numel: int, dtype: torch.dtype
) -> Iterator[Quantized]:
    """The rows of `buffer`, as `_pack` made them (`blocks` blocks each), as `Quantized` of
    `numel` elements and `dtype`: one row, one peer, at a time (memory for one row's values)."""
    split = 4 * blocks
    for row in buffer:
        scales = row[:split].clone()  # a copy: a row's scales start at any byte, float32 needs 4
        data = row[split:]
        yield Quantized(
            data.view(torch.int8) if bits == 8 else data,
            scales.view(torch.float32),
            numel,
            bits,
            block_size,
            dtype,
        )


def _summed(buffer: torch.Tensor, blocks: int, bits: int, block_size: int) -> torch.Tensor:
    """The float32 sum of the rows of `buffer` dequantized: ``blocks * block_size`` elements,
    the padding included (zeros)."""
    total: torch.Tensor | None = None
    for q in _rows(buffer, blocks, bits, block_size, blocks * block_size, torch.float32):
        values = dequantize(q)  # a new float32 tensor
        total = values if total is None else total.add_(values)
    assert total is not None  # a buffer of no rows is never exchanged
    return total


def _padded(chunks: torch.Tensor, block_size: int) -> torch.Tensor:
    """`chunks` (last dimension: one chunk) padded with zeros to whole blocks, so that each
    chunk is quantized on its own."""
    n = chunks.shape[-1]
    pad = _blocks(n, block_size) * block_size - n
    return torch.nn.functional.pad(chunks, (0, pad)) if pad else chunks


def all_gather_quantized(
    output: torch.Tensor,
    input: torch.Tensor | Quantized,
    *,
    bits: int | None = None,
    block_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """ZeRO++ qwZ's all-gather: every rank's `input` (1-D, its shard, a floating dtype)
    quantized in blocks of `block_size` at `bits` (8 or 4) bits, gathered, and dequantized
    into its slice of `output` (1-D, group size times input's elements, any floating dtype)
    in rank order.

    Every element is within half its block's scale of the shard's (`quantize`'s bound), and
    every rank gets the same `output`, this rank's slice included. The shards are of one size;
    `block_size` need not divide it (each shard's last block is padded). `input` may be this
    rank's slice of `output`. With `async_op` the dequantization runs in the handle's
    ``wait()``. A group of one copies `input` exactly. The bytes are an
    ``all_gather_into_tensor``'s (see `quantized_collective_nbytes`). `bits` and `block_size`
    default to 8 and 2048.

    `input` may also be a shard quantized already (a `Quantized`, as ZeRO++'s MixZ++ keeps
    frozen weights): its codes go as they are, in its own format (`bits` and `block_size`,
    if given, must match it), and every rank's slice of `output`, a group of one's too, is
    exactly its dequantized values.
    """
    op = "all_gather_quantized"
    if isinstance(input, Quantized):
        return _all_gather_codes(output, input, bits, block_size, group, async_op)
    bits = 8 if bits is None else bits
    block_size = 2048 if block_size is None else block_size
    size = _check_arguments(op, ("input", input), ("output", output), bits, block_size, group)
    n = input.numel()
    if size == 1 or n == 0:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return completed(op)
    return _gather_packed(
        output, _quantize(input, bits, block_size, False, None), size, group, async_op
    )


def _all_gather_codes(
    output: torch.Tensor,
    q: Quantized,
    bits: int | None,
    block_size: int | None,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> Handle:
    """`all_gather_quantized` of a shard quantized already."""
    op = "all_gather_quantized"
    for name, given, own in (("bits", bits, q.bits), ("block_size", block_size, q.block_size)):
        if given is not None and given != own:
            raise ValueError(f"{op}({name}={given}): the input is quantized with {name}={own}")
    _check_flat(op, "output", output)
    size = group_size(op, check_group(op, group))
    if q.data.device != output.device:
        raise ValueError(f"{op}: input is on {q.data.device}, but output is on {output.device}")
    if output.numel() != q.numel * size:
        raise ValueError(
            f"{op}: output has {output.numel()} elements, expected input.numel * group size = "
            f"{q.numel} * {size} = {q.numel * size}"
        )
    if size == 1 or q.numel == 0:
        dequantize(dataclasses.replace(q, dtype=output.dtype), out=output)
        return completed(op)
    return _gather_packed(output, q, size, group, async_op)


def _gather_packed(
    output: torch.Tensor,
    q: Quantized,
    size: int,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> Handle:
    """Every rank's `q` gathered and dequantized into its slice of `output`, in rank order."""
    n, bits, block_size = q.numel, q.bits, q.block_size
    blocks = _blocks(n, block_size)
    mine = _pack(q, 1).view(-1)
    gathered = torch.empty(size * mine.numel(), dtype=torch.uint8, device=mine.device)

    def dequantize_into_output() -> None:
        rows = _rows(gathered.view(size, -1), blocks, bits, block_size, n, output.dtype)
        for r, row in enumerate(rows):
            dequantize(row, out=output[r * n : (r + 1) * n])

    op = "all_gather_quantized"
    inner = all_gather_into_tensor(gathered, mine, group=group, async_op=async_op)
    return _then(op, group, inner, dequantize_into_output, async_op, keep=mine)


def reduce_scatter_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    bits: int = 8,
    block_size: int = 2048,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    hierarchical: bool = False,
    async_op: bool = False,
) -> Handle:
    """ZeRO++ qgZ's reduce-scatter: `input` (1-D, group size times output's elements, chunk r
    for rank r as `reduce_scatter_tensor` takes it) reduced across `group` with `op` (SUM or
    AVG), this rank's chunk written into `output` (1-D, any floating dtype).

    Each rank quantizes each destination chunk on its own (`bits`, `block_size`, and
    `stochastic` rounding with `generator` as `quantize` takes them) and one all-to-all moves
    them; each rank dequantizes the chunks it received and sums them in float32. Each rank's
    contribution is within half its block's scale (one with `stochastic`) of its chunk.

    `hierarchical=True` (ZeRO++'s hierarchical all-to-all, `group` None: the world, cut into
    `node_layout()`'s nodes of L ranks): first within the node, each rank sends local rank l
    the chunks of the world ranks n * L + l of every node n, and sums in float32 what its
    node's ranks sent; then those partial sums are quantized again and exchanged with the
    ranks of its local rank on the other nodes, and summed into this rank's chunk. Only the
    second stage crosses nodes, with 1 / L of the flat all-to-all's bytes; its re-quantization
    adds up to half a scale of each partial sum. On one node, or with one rank per node, it
    is the flat reduce-scatter.

    `output` may be part of `input` (all of input is read first). With `async_op` the
    reduction (and the second stage) runs in the handle's ``wait()``. A group of one copies
    `input` exactly. The bytes are ``all_to_all_single``'s (see `quantized_collective_nbytes`).
    """
    name = "reduce_scatter_quantized"
    size = _check_arguments(name, ("output", output), ("input", input), bits, block_size, group)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{name}(op=...): expected ReduceOp.SUM or ReduceOp.AVG, got {op!r}")
    if hierarchical and group is not None:
        raise ValueError(
            f"{name}(hierarchical=True): reduces over the world, which the nodes split; "
            "got a group (pass group=None)"
        )
    n = output.numel()
    if size == 1 or n == 0:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return completed(name)
    blocks = _blocks(n, block_size)

    def exchange(
        chunks: torch.Tensor, rows: int, on: dist.ProcessGroup | None, a: bool
    ) -> tuple[Handle, torch.Tensor, torch.Tensor]:
        """Quantize `chunks`, send the r-th of its `rows` parts to rank r of `on`."""
        send = _pack(_quantize(chunks, bits, block_size, stochastic, generator), rows)
        received = torch.empty_like(send)
        return all_to_all_single(received, send, group=on, async_op=a), received, send

    def write(received: torch.Tensor) -> None:
        """Sum the chunks of this rank received from every peer into `output`."""
        total = _summed(received, blocks, bits, block_size)[:n]
        output.copy_(total / size if op == ReduceOp.AVG else total)

    layout = node_layout() if hierarchical else None
    if layout is None or layout.nodes == 1 or layout.ranks_per_node == 1:
        chunks = _padded(input.view(size, n), block_size)
        inner, received, send = exchange(chunks, size, group, async_op)
        return _then(name, group, inner, lambda: write(received), async_op, keep=send)

    per_node, nodes = layout.ranks_per_node, layout.nodes
    within, across = intra_node_group(), inter_node_group()  # built now: collective calls
    # local rank l gets the chunks of world ranks n * L + l, node by node
    by_local = _padded(input.view(nodes, per_node, n).transpose(0, 1), block_size)
    inner, received, send = exchange(by_local, per_node, within, async_op)

    def across_nodes() -> None:
        # this node's sum of the chunks of world ranks n * L + l (l: this rank's), node by node
        partial = _summed(received, nodes * blocks, bits, block_size)
        write(exchange(partial, nodes, across, False)[1])

    return _then(name, None, inner, across_nodes, async_op, keep=send)


def quantized_collective_nbytes(
    op: str,
    numel: int,
    *,
    group_size: int,
    bits: int = 8,
    block_size: int = 2048,
    nodes: int = 1,
    hierarchical: bool = False,
) -> dict[str, int]:
    """The bytes one call of `op` records on each rank, by link class as `comm_bytes_by_link`
    counts them: ``{"intra_node": ..., "inter_node": ...}``.

    `op` is ``"all_gather_quantized"`` or ``"reduce_scatter_quantized"``, `numel` the elements
    of a shard (the all-gather's input, the reduce-scatter's output), `nodes` the number of
    nodes the group's ranks span (1: one node). With q = ``quantized_nbytes(numel, bits=bits,
    block_size=block_size)``, W = `group_size`, N = `nodes` and L = W / N:

    - all_gather_quantized: W * q, recorded as an ``all_gather_into_tensor``;
    - reduce_scatter_quantized: W * q, recorded as an ``all_to_all_single``;
    - hierarchical (N > 1 and L > 1): W * q within the nodes, then N * q across them.

    Every byte is inter-node when N > 1 but for the hierarchical first stage's; a group of one
    or empty shards record nothing.
    """
    if op not in _OPS:
        raise ValueError(f"quantized_collective_nbytes(op=...): expected one of {_OPS}, got {op!r}")
    for name, value in (("group_size", group_size), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"quantized_collective_nbytes({name}=...): expected a positive int, got {value!r}"
            )
    if group_size % nodes:
        raise ValueError(
            f"quantized_collective_nbytes: nodes={nodes} does not divide group_size={group_size}"
        )
    if hierarchical and op != "reduce_scatter_quantized":
        raise ValueError(
            "quantized_collective_nbytes(hierarchical=True): reduce_scatter_quantized only"
        )
    q = quantized_nbytes(numel, bits=bits, block_size=block_size)
    if group_size == 1 or numel == 0:
        return {"intra_node": 0, "inter_node": 0}
    if hierarchical and nodes > 1 and group_size > nodes:
        return {"intra_node": group_size * q, "inter_node": nodes * q}
    link = "inter_node" if nodes > 1 else "intra_node"
    return {"intra_node": 0, "inter_node": 0, link: group_size * q}
