"""ZeRO++'s quantized collectives on real gloo ranks (1, 2 and 4, and 4 as 2 nodes of 2):
within the quantization bound of the fp32 collective, the bytes the accounting records, the
hierarchical reduce-scatter's bytes across nodes, and the errors.

The bounds, per element, with s_r the scale of the block holding it in rank r's quantization
of its own shard (all-gather) or of the destination chunk (reduce-scatter), c = 1/2 for round
to nearest and 1 for stochastic rounding (`quantize`'s bound), qmax = 127 or 7:

- all-gather: c * s_r (each element comes from one rank);
- flat reduce-scatter: c * sum_r s_r (each rank's contribution is off by its own bound);
- hierarchical: the partial sum P of a node is off by E <= c * sum_{r in node} s_r; its block
  absmax is then at most sum_r absmax_r + E <= (qmax + c) * sum_r s_r, so the re-quantization's
  scale is at most (1 + c / qmax) * sum_r s_r and adds c times that: c * (2 + c / qmax) *
  sum_r s_r over all ranks;
- AVG: the SUM bound divided by the world size.

On top of each: float32 rounding (of x / s, q * s and the sums, both ours and the reference's),
_F32_SLACK relative to sum_r |x_r|, and a bf16 output's own rounding, 2**-8 relative.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zcomm
from zcomm.testing import DistributedTest

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
_QMAX = {8: 127, 4: 7}
_F32_SLACK = 2.0**-20
_BF16 = 2.0**-8
_TINY = 2.0**-126


def _data(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank `rank`'s tensor: normal values of varied magnitude (one scale per 16 elements,
    from 2**-6 to 2**6) and some exact zeros, the same wherever it is made."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(numel, generator=g)
    x *= 2.0 ** torch.randint(-6, 7, (-(-numel // 16),), generator=g).repeat_interleave(16)[:numel]
    x[torch.rand(numel, generator=g) < 0.1] = 0.0
    return x.to(dtype)


def _scales(x: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """Each element's block scale in `quantize`'s quantization of `x`."""
    q = zcomm.quantize(x, bits=bits, block_size=block_size)
    return q.scales.repeat_interleave(block_size)[: x.numel()]


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, size: torch.Tensor) -> None:
    """|got - want| <= bound + float32 slack relative to `size` (+ bf16 rounding of got)."""
    tol = bound + _F32_SLACK * size + _TINY
    if got.dtype == torch.bfloat16:
        tol = tol + _BF16 * got.float().abs()
    err = (got.double() - want.double()).abs()
    assert bool((err <= tol).all()), f"worst excess {(err - tol).max().item():.3g}"


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors).sum(dim=0)


def _shard_values(x: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """What the all-gather delivers for shard `x`: its dequantized values in float32."""
    q = zcomm.quantize(x, bits=bits, block_size=block_size)
    return zcomm.dequantize(dataclasses.replace(q, dtype=torch.float32))


class TestQuantizedCollectives(DistributedTest):
    @SIZES
    def test_all_gather_quantized(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        n, block = 100, 32  # 4 blocks per shard, the last padded
        cases = [
            (8, torch.float32, torch.float32),
            (4, torch.float32, torch.bfloat16),
            (8, torch.bfloat16, torch.bfloat16),
            (4, torch.bfloat16, torch.float32),
        ]
        for bits, in_dtype, out_dtype in cases:
            shards = [_data(r, n, in_dtype) for r in range(world_size)]
            out = torch.full((world_size * n,), float("nan"), dtype=out_dtype)
            zcomm.all_gather_quantized(out, shards[rank], bits=bits, block_size=block)
            for r, x in enumerate(shards):
                got = out[r * n : (r + 1) * n]
                if world_size == 1:
                    assert torch.equal(got, x.to(out_dtype))  # nothing sent: exact
                    continue
                # the same on every rank, this rank's slice too: the dequantized shard
                want = _shard_values(x, bits, block).to(out_dtype)
                assert torch.equal(got, want), (bits, in_dtype, out_dtype, r)
                _within(got, x.float(), 0.5 * _scales(x, bits, block), x.float().abs())
                assert bool((got[x == 0] == 0).all())

        # zero shards come back exact; in place (the shard is this rank's slice of output),
        # asynchronously, the dequantization in wait()
        out = torch.zeros(world_size * n)
        zcomm.all_gather_quantized(out, torch.zeros(n))
        assert torch.equal(out, torch.zeros(world_size * n))
        full = torch.cat([_data(r, n) for r in range(world_size)])
        handle = zcomm.all_gather_quantized(full, full[rank * n : (rank + 1) * n], async_op=True)
        handle.wait()
        assert handle.is_completed()
        want = torch.cat([_shard_values(_data(r, n), 8, 2048) for r in range(world_size)])
        assert torch.equal(full, want if world_size > 1 else torch.cat([_data(0, n)]))

        # the accounting: exactly the formula's bytes, as an all_gather_into_tensor, about 1/4
        # and 1/8 of the fp32 all-gather's (plus 4 bytes of scale per block)
        n, block = 256, 64
        zcomm.enable_comm_accounting()
        for bits in (8, 4):
            zcomm.reset_comm_accounting()
            zcomm.all_gather_quantized(
                torch.empty(world_size * n), _data(rank, n), bits=bits, block_size=block
            )
            want_bytes = zcomm.quantized_collective_nbytes(
                "all_gather_quantized", n, group_size=world_size, bits=bits, block_size=block
            )
            assert zcomm.comm_bytes_by_link() == want_bytes
            recorded = sum(s.bytes for s in zcomm.comm_summary().values())
            assert recorded == sum(want_bytes.values())
            if world_size == 1:
                assert recorded == 0
                continue
            assert zcomm.comm_summary()["all_gather_into_tensor"].count == 1
            zcomm.reset_comm_accounting()
            zcomm.all_gather_into_tensor(torch.empty(world_size * n), _data(rank, n))
            fp32 = zcomm.comm_summary()["all_gather_into_tensor"].bytes
            assert recorded == fp32 * (bits / 32 + 1 / block)

        # a shard quantized already (MixZ++'s frozen weights): its codes go as they are, and
        # every slice is exactly their dequantized values, a group of one's too; the bytes
        # are the same as quantizing on the way
        for bits in (8, 4):
            stored = [zcomm.quantize(_data(r, n), bits=bits, block_size=block) for r in range(4)]
            out = torch.full((world_size * n,), float("nan"), dtype=torch.bfloat16)
            zcomm.reset_comm_accounting()
            zcomm.all_gather_quantized(out, stored[rank])
            assert zcomm.comm_bytes_by_link() == zcomm.quantized_collective_nbytes(
                "all_gather_quantized", n, group_size=world_size, bits=bits, block_size=block
            )
            for r in range(world_size):
                want = zcomm.dequantize(stored[r]).to(torch.bfloat16)
                assert torch.equal(out[r * n : (r + 1) * n], want), (bits, r)
        with pytest.raises(ValueError, match=r"\(bits=4\): the input is quantized with bits=8"):
            zcomm.all_gather_quantized(
                torch.empty(world_size * n), zcomm.quantize(_data(rank, n)), bits=4
            )
        with pytest.raises(ValueError, match=r"output has 3 elements, expected input\.numel"):
            zcomm.all_gather_quantized(torch.empty(3), zcomm.quantize(_data(rank, n)))
        zcomm.enable_comm_accounting(False)

        if world_size > 1:  # a non-finite value: its block arrives as NaN, nobody waits
            x = _data(rank, n)
            x[3] = float("inf") if rank == 0 else x[3]
            out = torch.empty(world_size * n)
            zcomm.all_gather_quantized(out, x, block_size=64)
            assert bool(out[:64].isnan().all())
            assert bool(out[64:].isfinite().all())

    @SIZES
    def test_reduce_scatter_quantized(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        n, block = 72, 16  # 5 blocks per chunk, the last padded
        mine = slice(rank * n, (rank + 1) * n)
        inputs = [_data(r, world_size * n) for r in range(world_size)]
        # each rank's chunk for this rank, their scales and magnitudes
        scale_sum = {bits: _sum([_scales(x[mine], bits, block) for x in inputs]) for bits in (8, 4)}
        size = _sum([x[mine].abs() for x in inputs])
        for bits in (8, 4):
            for op in (zcomm.ReduceOp.SUM, zcomm.ReduceOp.AVG):
                div = world_size if op == zcomm.ReduceOp.AVG else 1
                ref = torch.empty(n)
                zcomm.reduce_scatter_tensor(ref, inputs[rank].clone(), op=op)
                for out_dtype in (torch.float32, torch.bfloat16):
                    out = torch.empty(n, dtype=out_dtype)
                    zcomm.reduce_scatter_quantized(
                        out, inputs[rank], bits=bits, block_size=block, op=op
                    )
                    if world_size == 1:
                        assert torch.equal(out, inputs[0].to(out_dtype))  # nothing sent: exact
                        continue
                    bound = 0.5 * scale_sum[bits] / div
                    _within(out, ref, bound, size / div)

        # stochastic rounding: within one scale per rank, and repeatable with a seed
        def stochastic(seed: int) -> torch.Tensor:
            out = torch.empty(n)
            g = torch.Generator().manual_seed(seed + rank)
            zcomm.reduce_scatter_quantized(
                out, inputs[rank], bits=4, block_size=block, stochastic=True, generator=g
            )
            return out

        first = stochastic(7)
        assert torch.equal(stochastic(7), first)
        ref = torch.empty(n)
        zcomm.reduce_scatter_tensor(ref, inputs[rank].clone())
        if world_size > 1:
            assert not torch.equal(stochastic(8), first)
            _within(first, ref, scale_sum[4], size)

        # asynchronous, in place (output: this rank's chunk of input), bytes as the formula
        zcomm.enable_comm_accounting()
        expected = torch.empty(n)
        zcomm.reduce_scatter_quantized(expected, inputs[rank], op=zcomm.ReduceOp.AVG)
        zcomm.reset_comm_accounting()
        full = inputs[rank].clone()
        handle = zcomm.reduce_scatter_quantized(
            full[mine], full, op=zcomm.ReduceOp.AVG, async_op=True
        )
        handle.wait()
        assert handle.is_completed()
        assert torch.equal(full[mine], expected)
        want_bytes = zcomm.quantized_collective_nbytes(
            "reduce_scatter_quantized", n, group_size=world_size
        )
        assert zcomm.comm_bytes_by_link() == want_bytes
        if world_size > 1:
            assert zcomm.comm_summary()["all_to_all_single"].bytes == world_size * (4 + 2048)

        if world_size > 1:  # a non-finite value: its block arrives as NaN on every rank
            x = inputs[rank].clone()
            if rank == 0:
                x.view(world_size, n)[:, 20] = float("nan")  # block 1 of every chunk
            out = torch.empty(n)
            zcomm.reduce_scatter_quantized(out, x, block_size=block)
            assert bool(out[16:32].isnan().all())
            assert bool(out[:16].isfinite().all() and out[32:].isfinite().all())

    @pytest.mark.world_size(4)
    def test_hierarchical_reduce_scatter_on_two_nodes(self) -> None:
        rank = zcomm.get_rank()
        world, nodes = 4, 2
        n, block = 40, 16  # 3 blocks per chunk, the last padded
        mine = slice(rank * n, (rank + 1) * n)
        inputs = [_data(r, world * n) for r in range(world)]
        size = _sum([x[mine].abs() for x in inputs])

        def run(
            *,
            bits: int = 8,
            op: zcomm.ReduceOp.RedOpType = zcomm.ReduceOp.SUM,
            hierarchical: bool = False,
        ) -> torch.Tensor:
            out = torch.empty(n)
            zcomm.reduce_scatter_quantized(
                out, inputs[rank], bits=bits, block_size=block, op=op, hierarchical=hierarchical
            )
            return out

        # one node: the flat reduce-scatter, bit for bit
        zcomm.set_node_layout(4)
        flat = run()
        assert torch.equal(run(hierarchical=True), flat)

        zcomm.set_node_layout(nodes)
        zcomm.enable_comm_accounting()
        for bits in (8, 4):
            c, scale_sum = 0.5, _sum([_scales(x[mine], bits, block) for x in inputs])
            bound = c * (2 + c / _QMAX[bits]) * scale_sum
            for op in (zcomm.ReduceOp.SUM, zcomm.ReduceOp.AVG):
                div = world if op == zcomm.ReduceOp.AVG else 1
                ref = torch.empty(n)
                zcomm.reduce_scatter_tensor(ref, inputs[rank].clone(), op=op)
                zcomm.reset_comm_accounting()
                got = run(hierarchical=True, bits=bits, op=op)
                _within(got, ref, bound / div, size / div)
                # only the second stage crosses nodes: N * q, against W * q within them
                want = zcomm.quantized_collective_nbytes(
                    "reduce_scatter_quantized",
                    n,
                    group_size=world,
                    bits=bits,
                    block_size=block,
                    nodes=nodes,
                    hierarchical=True,
                )
                q = zcomm.quantized_nbytes(n, bits=bits, block_size=block)
                assert want == {"intra_node": world * q, "inter_node": nodes * q}
                assert zcomm.comm_bytes_by_link() == want
                stats = zcomm.comm_summary()["all_to_all_single"]
                assert (stats.count, stats.inter_node_bytes) == (2, nodes * q)
                # the flat one on the same nodes: all of its W * q cross them
                zcomm.reset_comm_accounting()
                run(bits=bits, op=op)
                assert zcomm.comm_bytes_by_link() == {"intra_node": 0, "inter_node": world * q}

        # asynchronous (the second stage runs in wait()) and stochastic, seeded: repeatable
        def stochastic(seed: int) -> torch.Tensor:
            out = torch.empty(n)
            g = torch.Generator().manual_seed(seed + rank)
            handle = zcomm.reduce_scatter_quantized(
                out,
                inputs[rank],
                block_size=block,
                stochastic=True,
                generator=g,
                hierarchical=True,
                async_op=True,
            )
            handle.wait()
            return out

        first = stochastic(3)
        assert torch.equal(stochastic(3), first)
        ref = torch.empty(n)
        zcomm.reduce_scatter_tensor(ref, inputs[rank].clone())
        scale_sum = _sum([_scales(x[mine], 8, block) for x in inputs])
        _within(first, ref, (2 + 1 / 127) * scale_sum, size)

        # four nodes of one rank: the flat all-to-all, across nodes
        zcomm.set_node_layout(1)
        zcomm.reset_comm_accounting()
        assert torch.equal(run(hierarchical=True), flat)
        q = zcomm.quantized_nbytes(n, bits=8, block_size=block)
        assert zcomm.comm_bytes_by_link() == {"intra_node": 0, "inter_node": world * q}

    @pytest.mark.world_size(2)
    def test_all_to_all_single_and_errors(self) -> None:
        rank = zcomm.get_rank()
        # all_to_all_single: chunk r to rank r, along dim 0
        out = torch.empty(2, 3)
        zcomm.all_to_all_single(out, torch.arange(6.0).view(2, 3) + 10 * rank).wait()
        assert out.tolist() == [[3.0 * rank + i + 10 * r for i in range(3)] for r in range(2)]
        with pytest.raises(ValueError, match="output has shape"):
            zcomm.all_to_all_single(torch.empty(4), torch.empty(2))
        with pytest.raises(ValueError, match="split into group size = 2"):
            zcomm.all_to_all_single(torch.empty(3), torch.empty(3))
        with pytest.raises(TypeError, match="dtype"):
            zcomm.all_to_all_single(torch.empty(2), torch.empty(2, dtype=torch.float16))
        t = torch.empty(4)
        with pytest.raises(ValueError, match="overlaps"):
            zcomm.all_to_all_single(t, t)

        gather, scatter = zcomm.all_gather_quantized, zcomm.reduce_scatter_quantized
        with pytest.raises(ValueError, match=r"output has 5 elements, expected input.numel\(\)"):
            gather(torch.empty(5), torch.empty(3))
        with pytest.raises(ValueError, match=r"input has 5 elements, expected output.numel\(\)"):
            scatter(torch.empty(3), torch.empty(5))
        with pytest.raises(ValueError, match=r"all_gather_quantized\(input=...\): expected a 1-D"):
            gather(torch.empty(4, 2), torch.empty(2, 2))
        with pytest.raises(ValueError, match=r"\(output=...\): expected a 1-D"):
            scatter(torch.empty(1, 2), torch.empty(4))
        with pytest.raises(TypeError, match=r"\(input=...\): expected a floating dtype"):
            gather(torch.empty(4), torch.ones(2, dtype=torch.int32))
        with pytest.raises(TypeError, match=r"\(output=...\): expected a torch.Tensor"):
            scatter([0.0], torch.empty(2))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="bits: expected 4 or 8, got 16"):
            gather(torch.empty(4), torch.empty(2), bits=16)
        with pytest.raises(ValueError, match="block_size: must be even for bits=4"):
            scatter(torch.empty(2), torch.empty(4), bits=4, block_size=7)
        with pytest.raises(ValueError, match=r"op=...\): expected ReduceOp.SUM or ReduceOp.AVG"):
            scatter(torch.empty(2), torch.empty(4), op=zcomm.ReduceOp.MAX)
        group = zcomm.new_group([0, 1])
        with pytest.raises(ValueError, match=r"hierarchical=True\): reduces over the world"):
            scatter(torch.empty(2), torch.empty(4), group=group, hierarchical=True)
        # what passed the checks still works on both ranks (no rank left waiting)
        out = torch.empty(2)
        scatter(out, torch.ones(4), group=group)
        assert out.tolist() == [2.0, 2.0]


def test_quantized_collective_nbytes() -> None:
    nbytes = zcomm.quantized_collective_nbytes
    q = zcomm.quantized_nbytes(1000, bits=4, block_size=256)
    assert q == 4 * (128 + 4)
    for op in ("all_gather_quantized", "reduce_scatter_quantized"):
        got = nbytes(op, 1000, group_size=8, bits=4, block_size=256)
        assert got == {"intra_node": 8 * q, "inter_node": 0}
        got = nbytes(op, 1000, group_size=8, bits=4, block_size=256, nodes=2)
        assert got == {"intra_node": 0, "inter_node": 8 * q}
        assert nbytes(op, 1000, group_size=1) == {"intra_node": 0, "inter_node": 0}
        assert nbytes(op, 0, group_size=4) == {"intra_node": 0, "inter_node": 0}
    scatter = "reduce_scatter_quantized"
    got = nbytes(scatter, 1000, group_size=8, bits=4, block_size=256, nodes=2, hierarchical=True)
    assert got == {"intra_node": 8 * q, "inter_node": 2 * q}
    # one node, or one rank per node: the flat one
    assert nbytes(scatter, 10, group_size=4, hierarchical=True) == nbytes(scatter, 10, group_size=4)
    got = nbytes(scatter, 10, group_size=4, nodes=4, hierarchical=True)
    assert got == nbytes(scatter, 10, group_size=4, nodes=4)
    with pytest.raises(ValueError, match=r"op=\.\.\."):
        nbytes("all_reduce", 10, group_size=2)
    with pytest.raises(ValueError, match="nodes=3 does not divide group_size=4"):
        nbytes(scatter, 10, group_size=4, nodes=3)
    with pytest.raises(ValueError, match="reduce_scatter_quantized only"):
        nbytes("all_gather_quantized", 10, group_size=4, nodes=2, hierarchical=True)
    with pytest.raises(ValueError, match="bits"):
        nbytes(scatter, 10, group_size=4, bits=2)
