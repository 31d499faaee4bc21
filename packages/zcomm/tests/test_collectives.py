"""Collectives at world sizes 1, 2 and 4, checked against values computed locally."""

from __future__ import annotations

import pytest
import torch

import zcomm
from zcomm.testing import DistributedTest

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])


def _rank_tensor(n: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What rank `rank` contributes: distinct values per rank and element."""
    return (torch.arange(n, dtype=torch.float32) + 100 * rank).to(dtype)


class TestCollectives(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("async_op", [False, True])
    def test_all_reduce_sum(self, world_size: int, async_op: bool) -> None:
        rank = zcomm.get_rank()
        t = _rank_tensor(5, rank)
        handle = zcomm.all_reduce(t, async_op=async_op)
        handle.wait()
        assert handle.is_completed()
        expected = sum(_rank_tensor(5, r) for r in range(world_size))
        torch.testing.assert_close(t, expected)

    @SIZES
    def test_all_reduce_ops(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        contributions = [_rank_tensor(4, r) for r in range(world_size)]
        for op, reference in [
            (zcomm.ReduceOp.MAX, torch.stack(contributions).amax(0)),
            (zcomm.ReduceOp.MIN, torch.stack(contributions).amin(0)),
            (zcomm.ReduceOp.AVG, torch.stack(contributions).mean(0)),
        ]:
            t = _rank_tensor(4, rank)
            zcomm.all_reduce(t, op=op)
            torch.testing.assert_close(t, reference)

    @SIZES
    def test_all_reduce_dtypes(self, world_size: int) -> None:
        for dtype in (torch.bfloat16, torch.float16, torch.int64):
            t = torch.ones(3, dtype=dtype)
            zcomm.all_reduce(t)
            assert t.dtype == dtype
            assert t.tolist() == [world_size] * 3

    @SIZES
    @pytest.mark.parametrize("async_op", [False, True])
    def test_broadcast(self, world_size: int, async_op: bool) -> None:
        src = world_size - 1
        t = _rank_tensor(6, zcomm.get_rank())
        zcomm.broadcast(t, src, async_op=async_op).wait()
        torch.testing.assert_close(t, _rank_tensor(6, src))

    @SIZES
    @pytest.mark.parametrize("async_op", [False, True])
    @pytest.mark.parametrize("op", ["sum", "avg"])
    def test_reduce(self, world_size: int, async_op: bool, op: str) -> None:
        dst = world_size - 1  # not rank 0: the destination is a global rank
        t = _rank_tensor(6, zcomm.get_rank())
        reduce_op = zcomm.ReduceOp.SUM if op == "sum" else zcomm.ReduceOp.AVG
        zcomm.reduce(t, dst, op=reduce_op, async_op=async_op).wait()
        if zcomm.get_rank() == dst:
            total = sum(_rank_tensor(6, r) for r in range(world_size))
            torch.testing.assert_close(t, total if op == "sum" else total / world_size)
        with pytest.raises(ValueError, match="dst"):
            zcomm.reduce(t, world_size)  # no such rank

    @SIZES
    @pytest.mark.parametrize("async_op", [False, True])
    def test_all_gather_into_a_list(self, world_size: int, async_op: bool) -> None:
        mine = _rank_tensor(3, zcomm.get_rank()).view(1, 3)
        out = [torch.empty(1, 3) for _ in range(world_size)]
        zcomm.all_gather(out, mine, async_op=async_op).wait()
        for r, got in enumerate(out):
            torch.testing.assert_close(got, _rank_tensor(3, r).view(1, 3))
        with pytest.raises(ValueError, match=f"must hold {world_size} tensors"):
            zcomm.all_gather([*out, torch.empty(1, 3)], mine)
        with pytest.raises(ValueError, match=r"tensor_list\[0\] has shape \(3,\)"):
            zcomm.all_gather([torch.empty(3)] * world_size, mine)

    @SIZES
    def test_arguments_by_position_as_torch_takes_them(self, world_size: int) -> None:
        """``dist.all_reduce(t, dist.ReduceOp.MAX, group)``: torch.distributed's and DeepSpeed's
        order, for code written against them."""
        rank = zcomm.get_rank()
        t = torch.full((2,), float(rank))
        zcomm.all_reduce(t, zcomm.ReduceOp.MAX, None, False)
        assert torch.equal(t, torch.full((2,), world_size - 1.0))
        t = torch.full((2,), float(rank))
        zcomm.broadcast(t, world_size - 1, None, False)
        assert torch.equal(t, torch.full((2,), world_size - 1.0))
        t = torch.ones(2)
        zcomm.reduce(t, 0, zcomm.ReduceOp.SUM, None, False)
        out = torch.empty(2)
        zcomm.reduce_scatter_tensor(out, torch.ones(2 * world_size), zcomm.ReduceOp.SUM, None)
        assert torch.equal(out, torch.full((2,), float(world_size)))
        full = torch.empty(2 * world_size)
        zcomm.all_gather_into_tensor(full, torch.full((2,), float(rank)), None, False)
        assert torch.equal(full, torch.arange(world_size).repeat_interleave(2).float())
        zcomm.barrier(None)

    @SIZES
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_inference_all_reduce(self, world_size: int, dtype: torch.dtype) -> None:
        """DeepSpeed's inference_all_reduce: in place, done on return, op positional."""
        t = (torch.ones(3) * (zcomm.get_rank() + 1)).to(dtype)
        zcomm.inference_all_reduce(t)
        assert torch.equal(t, torch.full((3,), world_size * (world_size + 1) / 2, dtype=dtype))
        t = torch.full((2,), float(zcomm.get_rank()), dtype=dtype)
        zcomm.inference_all_reduce(t, zcomm.ReduceOp.MAX)
        assert torch.equal(t, torch.full((2,), world_size - 1.0, dtype=dtype))

    @SIZES
    @pytest.mark.parametrize("async_op", [False, True])
    def test_all_gather_into_tensor(self, world_size: int, async_op: bool) -> None:
        mine = _rank_tensor(3, zcomm.get_rank())
        out = torch.empty(3 * world_size)
        zcomm.all_gather_into_tensor(out, mine, async_op=async_op).wait()
        torch.testing.assert_close(out, torch.cat([_rank_tensor(3, r) for r in range(world_size)]))

    @SIZES
    @pytest.mark.parametrize("op", ["sum", "avg"])
    @pytest.mark.parametrize("scratch", [False, True])
    def test_reduce_scatter_tensor(self, world_size: int, op: str, scratch: bool) -> None:
        rank = zcomm.get_rank()
        full = _rank_tensor(4 * world_size, rank)
        given = full.clone()
        out = torch.empty(4)
        reduce_op = zcomm.ReduceOp.SUM if op == "sum" else zcomm.ReduceOp.AVG
        zcomm.reduce_scatter_tensor(
            out, full, op=reduce_op, async_op=True, scratch_input=scratch
        ).wait()
        total = sum(_rank_tensor(4 * world_size, r) for r in range(world_size))
        assert isinstance(total, torch.Tensor)
        expected = total if op == "sum" else total / world_size
        torch.testing.assert_close(out, expected[4 * rank : 4 * rank + 4])
        if not scratch:
            torch.testing.assert_close(full, given)  # the input is the caller's, untouched

    @pytest.mark.parametrize("world_size", [2, 4])
    def test_reduce_scatter_in_place_into_this_ranks_chunk(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        full = _rank_tensor(3 * world_size, rank)
        mine = full[3 * rank : 3 * rank + 3]
        zcomm.reduce_scatter_tensor(mine, full, op=zcomm.ReduceOp.AVG, scratch_input=True)
        total = sum(_rank_tensor(3 * world_size, r) for r in range(world_size))
        assert isinstance(total, torch.Tensor)
        torch.testing.assert_close(mine, (total / world_size)[3 * rank : 3 * rank + 3])
        # anything else that overlaps is refused, on every rank alike
        other = full[3 * ((rank + 1) % world_size) :][:3]
        with pytest.raises(ValueError, match="output overlaps input"):
            zcomm.reduce_scatter_tensor(other, full, scratch_input=True)
        with pytest.raises(ValueError, match="output overlaps input"):
            zcomm.reduce_scatter_tensor(mine, full)

    @pytest.mark.parametrize("world_size", [4])
    @pytest.mark.parametrize("scratch", [False, True])
    def test_reduce_scatter_in_a_subgroup_gives_each_its_group_rank_chunk(
        self, world_size: int, scratch: bool
    ) -> None:
        odd, even = zcomm.new_group([1, 3]), zcomm.new_group([0, 2])
        rank = zcomm.get_rank()
        group = odd if rank % 2 else even
        out = torch.empty(2)
        zcomm.reduce_scatter_tensor(out, _rank_tensor(4, rank), group=group, scratch_input=scratch)
        members = [1, 3] if rank % 2 else [0, 2]
        total = _rank_tensor(4, members[0]) + _rank_tensor(4, members[1])
        at = members.index(rank) * 2
        torch.testing.assert_close(out, total[at : at + 2])

    @SIZES
    def test_world_of_one_paths_copy(self, world_size: int) -> None:
        # The fast path must still produce the output, not just skip the call.
        groups = [zcomm.new_group([r]) for r in range(world_size)] if world_size > 1 else [None]
        group = groups[zcomm.get_rank()]
        mine = torch.arange(3.0)
        out = torch.zeros(3)
        zcomm.all_gather_into_tensor(out, mine, group=group)
        torch.testing.assert_close(out, mine)
        out = torch.zeros(3)
        zcomm.reduce_scatter_tensor(out, mine, group=group)
        torch.testing.assert_close(out, mine)

    @SIZES
    def test_barrier(self, world_size: int) -> None:
        zcomm.barrier()

    @SIZES
    def test_bad_arguments_name_the_argument(self, world_size: int) -> None:
        with pytest.raises(TypeError, match=r"all_reduce\(tensor=...\)"):
            zcomm.all_reduce([1.0, 2.0])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="output_tensor has 5 elements"):
            zcomm.all_gather_into_tensor(torch.empty(5), torch.empty(3))
        with pytest.raises(TypeError, match=r"output has dtype torch\.float16"):
            zcomm.reduce_scatter_tensor(
                torch.empty(1, dtype=torch.float16), torch.empty(world_size)
            )
        with pytest.raises(ValueError, match=r"broadcast\(src=7\)"):
            zcomm.broadcast(torch.empty(1), 7)
        with pytest.raises(TypeError, match=r"group=\.\.\."):
            zcomm.all_reduce(torch.empty(1), group="world")  # type: ignore[arg-type]


class TestBeforeInit(DistributedTest):
    world_size = 1
    init_distributed = False

    def test_collective_before_init_says_what_to_do(self) -> None:
        with pytest.raises(RuntimeError, match=r"call zcomm.init_distributed\(\) first"):
            zcomm.all_reduce(torch.ones(1))
        with pytest.raises(RuntimeError, match=r"zcomm.get_rank\(\)"):
            zcomm.get_rank()
