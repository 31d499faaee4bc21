"""[Note: host tensors on NCCL]: a collective whose tensors lie on the host while its group is
NCCL's runs on device copies and copies back what it wrote. NCCL needs a GPU per rank, which no
machine of this project has two of, so the copying is checked here over gloo: the staging device
is the CPU (copies all the same), taken for the first call of each collective (the collective it
makes on the copies runs as it is). Every collective's results must reach the caller's tensors,
synchronously and asynchronously, at world sizes 1, 2 and 4."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import zcomm
from zcomm import _collectives
from zcomm.testing import DistributedTest

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
ASYNC = pytest.mark.parametrize("async_op", [False, True])


@contextmanager
def staged_through_copies() -> Iterator[list[int]]:
    """Each collective called inside stages its tensors once (its own copies, on the CPU);
    yields the list of the staged calls' tensor counts."""
    staged: list[int] = []
    inner = [False]
    original = _collectives._staging_device

    def once(
        group: dist.ProcessGroup | None, tensors: Sequence[torch.Tensor]
    ) -> torch.device | None:
        if inner[0]:
            inner[0] = False  # the call on the copies: as it is
            return None
        inner[0] = True
        staged.append(len(tensors))
        return torch.device("cpu")

    _collectives._staging_device = once
    try:
        yield staged
    finally:
        _collectives._staging_device = original


def _rank_tensor(n: int, rank: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 100 * rank


def _run(call: Callable[[], zcomm.Handle], world_size: int) -> None:
    with staged_through_copies() as staged:
        call().wait()
    assert len(staged) == (world_size > 1)  # a world of one communicates nothing


class TestStaged(DistributedTest):
    @SIZES
    @ASYNC
    def test_all_reduce_reduce_and_broadcast_write_back(
        self, world_size: int, async_op: bool
    ) -> None:
        rank = zcomm.get_rank()
        total = sum(_rank_tensor(5, r) for r in range(world_size))
        t = _rank_tensor(5, rank)
        _run(lambda: zcomm.all_reduce(t, async_op=async_op), world_size)
        torch.testing.assert_close(t, total)
        t = _rank_tensor(5, rank)
        _run(lambda: zcomm.all_reduce(t, op=zcomm.ReduceOp.AVG, async_op=async_op), world_size)
        torch.testing.assert_close(t, total / world_size)
        t = _rank_tensor(5, rank)
        _run(lambda: zcomm.reduce(t, 0, async_op=async_op), world_size)
        if rank == 0:
            torch.testing.assert_close(t, total)
        t = _rank_tensor(5, rank)
        _run(lambda: zcomm.broadcast(t, world_size - 1, async_op=async_op), world_size)
        torch.testing.assert_close(t, _rank_tensor(5, world_size - 1))

    @SIZES
    @ASYNC
    def test_gathers_scatters_and_all_to_all_write_their_outputs(
        self, world_size: int, async_op: bool
    ) -> None:
        rank = zcomm.get_rank()
        everyone = torch.cat([_rank_tensor(4, r) for r in range(world_size)])
        out = torch.zeros(4 * world_size)
        mine = _rank_tensor(4, rank)
        _run(lambda: zcomm.all_gather_into_tensor(out, mine, async_op=async_op), world_size)
        torch.testing.assert_close(out, everyone)
        outs = [torch.zeros(4) for _ in range(world_size)]
        _run(lambda: zcomm.all_gather(outs, mine, async_op=async_op), world_size)
        torch.testing.assert_close(torch.cat(outs), everyone)
        full = torch.arange(4.0 * world_size) * (rank + 1)
        chunk = torch.zeros(4)
        _run(lambda: zcomm.reduce_scatter_tensor(chunk, full, async_op=async_op), world_size)
        scale = world_size * (world_size + 1) / 2  # the sum of (rank + 1) over the ranks
        torch.testing.assert_close(chunk, torch.arange(4.0 * rank, 4.0 * rank + 4) * scale)
        sent = _rank_tensor(2 * world_size, rank)
        got = torch.zeros(2 * world_size)
        _run(lambda: zcomm.all_to_all_single(got, sent, async_op=async_op), world_size)
        expected = torch.cat(
            [_rank_tensor(2 * world_size, r)[2 * rank : 2 * rank + 2] for r in range(world_size)]
        )
        torch.testing.assert_close(got, expected)


def test_device_tensors_and_other_backends_are_not_staged() -> None:
    # no process group needed: a tensor not on the host never asks for the backend
    meta = torch.empty(3, device="meta")
    assert _collectives._staging_device(None, [meta]) is None

    def never(copies: list[torch.Tensor]) -> zcomm.Handle:
        raise AssertionError("a device tensor was staged")

    assert _collectives._staged("all_reduce", None, [meta], [0], never, False) is None
