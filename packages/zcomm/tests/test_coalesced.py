"""Coalesced all-gather and reduce-scatter against one collective per tensor (the reference)."""

from __future__ import annotations

import pytest
import torch

import zcomm
from zcomm.testing import DistributedTest

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
SHAPES = [(3,), (2, 5), (1,), (4, 1, 2)]


def _shard(i: int, rank: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 1000 * i + 10 * rank


class TestCoalesced(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("async_op", [False, True])
    def test_all_gather_matches_per_tensor(self, world_size: int, async_op: bool) -> None:
        rank = zcomm.get_rank()
        inputs = [_shard(i, rank, torch.Size(s).numel()) for i, s in enumerate(SHAPES)]
        outputs = [torch.empty(world_size * t.numel()) for t in inputs]
        handle = zcomm.all_gather_coalesced(outputs, inputs, async_op=async_op)
        handle.wait()
        for inp, out in zip(inputs, outputs, strict=True):
            reference = torch.empty_like(out)
            zcomm.all_gather_into_tensor(reference, inp)
            torch.testing.assert_close(out, reference)

    @SIZES
    def test_all_gather_from_adjacent_shards(self, world_size: int) -> None:
        # Shards that are views of one flat partition are sent without a packing copy.
        rank = zcomm.get_rank()
        flat = torch.arange(10.0) + 100 * rank
        inputs = [flat[0:4], flat[4:5], flat[5:10]]
        outputs = [torch.empty(world_size * t.numel()).view(world_size, -1) for t in inputs]
        zcomm.all_gather_coalesced(outputs, inputs)
        for i, (start, stop) in enumerate([(0, 4), (4, 5), (5, 10)]):
            expected = torch.stack(
                [torch.arange(10.0)[start:stop] + 100 * r for r in range(world_size)]
            )
            torch.testing.assert_close(outputs[i], expected)

    @SIZES
    @pytest.mark.parametrize("adjacent", [False, True])
    @pytest.mark.parametrize("op", ["sum", "avg"])
    def test_reduce_scatter_matches_per_tensor(
        self, world_size: int, adjacent: bool, op: str
    ) -> None:
        rank = zcomm.get_rank()
        reduce_op = zcomm.ReduceOp.SUM if op == "sum" else zcomm.ReduceOp.AVG
        numels = [torch.Size(s).numel() for s in SHAPES]
        inputs = [_shard(i, rank, world_size * n) for i, n in enumerate(numels)]
        if adjacent:
            flat = torch.empty(sum(numels))
            outputs = list(flat.split(numels))
        else:
            outputs = [torch.empty(n) for n in numels]
        zcomm.reduce_scatter_coalesced(outputs, inputs, op=reduce_op, async_op=True).wait()
        for inp, out in zip(inputs, outputs, strict=True):
            reference = torch.empty_like(out)
            zcomm.reduce_scatter_tensor(reference, inp.clone(), op=reduce_op)
            torch.testing.assert_close(out, reference)

    @SIZES
    def test_one_collective_for_many_tensors(self, world_size: int) -> None:
        zcomm.enable_comm_accounting()
        inputs = [torch.ones(2) for _ in range(50)]
        outputs = [torch.empty(2 * world_size) for _ in range(50)]
        zcomm.all_gather_coalesced(outputs, inputs)
        zcomm.reduce_scatter_coalesced(inputs, outputs)
        summary = zcomm.comm_summary()
        if world_size == 1:
            assert summary == {}  # no communication at all
        else:
            assert summary["all_gather_coalesced"].count == 1
            assert summary["reduce_scatter_coalesced"].count == 1
            assert summary["all_gather_coalesced"].bytes == 50 * 2 * world_size * 4

    @SIZES
    def test_bad_arguments_name_the_argument(self, world_size: int) -> None:
        with pytest.raises(ValueError, match="inputs has 1 tensors but outputs has 2"):
            zcomm.all_gather_coalesced([torch.empty(world_size)] * 2, [torch.empty(1)])
        with pytest.raises(ValueError, match="inputs is empty"):
            zcomm.all_gather_coalesced([], [])
        with pytest.raises(TypeError, match=r"inputs\[1\] has dtype torch.float16"):
            zcomm.all_gather_coalesced(
                [torch.empty(world_size)] * 2, [torch.empty(1), torch.empty(1, dtype=torch.float16)]
            )
        with pytest.raises(ValueError, match=r"outputs\[0\] has 3 elements"):
            zcomm.all_gather_coalesced([torch.empty(3)], [torch.empty(2 if world_size != 1 else 4)])
        with pytest.raises(TypeError, match=r"inputs=\.\.\."):
            zcomm.reduce_scatter_coalesced([torch.empty(1)], torch.empty(1))  # type: ignore[arg-type]
