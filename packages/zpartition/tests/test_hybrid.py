"""Hybrid sharding (MiCS, HSDP): shards within a shard group, replicas across the replicate group;
parity with plain PyTorch, bytes across the replicas, reduction factors, Init, bad groups."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import ZeroParamConfig, ZeroParamError

from ._helpers import (
    TinyGPT,
    batches,
    groups,
    hybrid_groups,
    rank_grads,
    reference_losses,
    train_partitioned,
)

# (world size, shard group size): replicas x shard size of 2 x 1, 1 x 2, 4 x 1, 2 x 2, 1 x 4
LAYOUTS = pytest.mark.parametrize(("world_size", "shard"), [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
CONFIG = ZeroParamConfig(param_persistence_threshold=48)  # biases and norms in the persistent unit


def _seeded(seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with zpartition.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _hybrid(
    model: nn.Module, shard: int, config: ZeroParamConfig = CONFIG
) -> zpartition.Partitioned:
    group, replicate = hybrid_groups(shard)
    return zpartition.partition(model, config=config, group=group, replicate_group=replicate)


class TestParity(DistributedTest):
    @LAYOUTS
    @pytest.mark.parametrize(
        ("accumulation", "optimizer"), [(1, torch.optim.Adam), (4, torch.optim.SGD)]
    )
    def test_training_matches_plain_pytorch_on_the_whole_batch(
        self,
        world_size: int,
        shard: int,
        accumulation: int,
        optimizer: Callable[..., torch.optim.Optimizer],
    ) -> None:
        # each rank builds its own values: partition makes every replica global rank 0's
        model, reference = _seeded(zcomm.get_rank()), _seeded(0)
        handle = _hybrid(model, shard)
        assert (handle.replicate_group is None) == (shard == world_size)
        for p in model.parameters():  # shards of the shard group's size, on every replica
            assert p.ds_tensor.numel() == math.ceil(p.ds_numel / shard)
        data = batches(3, 4 * world_size)
        lr = 0.1 if optimizer is torch.optim.SGD else 0.01
        losses = train_partitioned(
            model,
            handle.shard_parameters(),
            data,
            lr,
            optimizer=optimizer,
            accumulation=accumulation,
            handle=handle,
        )
        expected = reference_losses(reference, data, lr, optimizer=optimizer)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
        for n, value in _full(model).items():  # on every rank: the replicas stayed equal
            torch.testing.assert_close(value, reference.get_parameter(n), rtol=1e-5, atol=1e-6)


def _all_reduced_bytes(handle: zpartition.Partitioned, tokens: torch.Tensor) -> int:
    """Bytes all-reduced (only the replicas all-reduce) in one forward and backward."""
    zcomm.reset_comm_accounting()
    handle.module(tokens).backward()
    stats = zcomm.comm_summary().get("all_reduce")
    return 0 if stats is None else stats.bytes


class TestReplicaTraffic(DistributedTest):
    @pytest.mark.parametrize(("world_size", "shard"), [(2, 1), (4, 2)])
    def test_replicas_communicate_at_the_accumulation_boundary_only(
        self, world_size: int, shard: int
    ) -> None:
        model = _seeded(0)
        handle = _hybrid(model, shard)
        micro = batches(4, 2)
        zcomm.enable_comm_accounting()
        try:
            handle.set_requires_all_reduce(False)
            inside = [_all_reduced_bytes(handle, tokens) for tokens in micro[:3]]
            handle.set_requires_all_reduce(True)
            boundary = _all_reduced_bytes(handle, micro[3])
        finally:
            zcomm.enable_comm_accounting(False)
        assert inside == [0, 0, 0]
        # every trainable shard gradient in fp32, and one presence flag per gradient group
        shards = sum(p.ds_tensor.numel() for p in model.parameters())
        groups = sum(len(u.grad_groups) for u in handle.units)
        assert boundary == 4 * (shards + groups)


def _my_chunk(full: torch.Tensor, shard: int) -> torch.Tensor:
    chunk = math.ceil(full.numel() / shard)
    flat = nn.functional.pad(full.reshape(-1), (0, chunk * shard - full.numel()))
    index = zcomm.get_rank() % shard
    return flat[index * chunk : (index + 1) * chunk]


class TestReductionFactors(DistributedTest):
    # every mode on 2 x 2; the other layouts once each (the suite's time is budgeted)
    @pytest.mark.parametrize(
        ("world_size", "shard", "mode"),
        [(4, 2, "mean"), (4, 2, "predivide"), (4, 2, "sum"), (2, 1, "predivide"), (4, 1, "sum")],
    )
    def test_each_factor_is_applied_once_across_accumulation_and_boundaries(
        self, world_size: int, shard: int, mode: str
    ) -> None:
        # DeepSpeed's options as zengine turns them into factors for the whole world: the mean
        # (AVG), gradient_predivide_factor 2 (1/2 before the sum, 2/world after), "sum". Two
        # boundaries without zero_grad in between: a sum already reduced is not summed again.
        scale = {"mean": None, "predivide": (0.5, 2 / world_size), "sum": (1.0, 1.0)}[mode]
        config = ZeroParamConfig(param_persistence_threshold=48, reduce_scale=scale)
        model, reference = _seeded(0), _seeded(0)
        handle = _hybrid(model, shard, config)
        data = batches(3, 2 * world_size)
        mine = [tokens.chunk(world_size)[zcomm.get_rank()] for tokens in data]
        for tokens, require in zip(mine, [False, True, True], strict=True):
            handle.set_requires_all_reduce(require)
            model(tokens).backward()
        summed = rank_grads(reference, data)
        factor = world_size if mode == "sum" else 1
        for n, p in model.named_parameters():
            expected = summed[n] / world_size * factor
            torch.testing.assert_close(p.ds_tensor.grad, _my_chunk(expected, shard), msg=n)

    @pytest.mark.parametrize(("world_size", "shard"), [(2, 1), (4, 2)])
    @pytest.mark.parametrize("scale", [None, (0.5, 0.5)])
    def test_a_sink_gets_the_shard_groups_reduction_and_its_owner_all_reduces(
        self, world_size: int, shard: int, scale: tuple[float, float] | None
    ) -> None:
        # (0.5, 0.5): the mean of 4 ranks, predivided by 2; at 2 ranks a sum times 1/2: both
        # reach the owner without the post-factor, which all_reduce_replicas applies
        if scale is not None and world_size == 2:
            scale = (0.5, 1.0)
        received: dict[int, torch.Tensor] = {}

        def sink(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
            for p, g in zip(params, grads, strict=True):
                received[p.ds_id] = received.get(p.ds_id, torch.zeros_like(g)) + g

        config = ZeroParamConfig(param_persistence_threshold=48, reduce_scale=scale)
        model, reference = _seeded(0), _seeded(0)
        handle = _hybrid(model, shard, config)
        handle.set_gradient_sink(sink)
        zcomm.enable_comm_accounting()
        try:
            zcomm.reset_comm_accounting()
            data = batches(2, 2 * world_size)
            for tokens in data:  # requires_all_reduce is True, and ignored with a sink
                model(tokens.chunk(world_size)[zcomm.get_rank()]).backward()
            assert "all_reduce" not in zcomm.comm_summary()
        finally:
            zcomm.enable_comm_accounting(False)
        ids = sorted(received)
        handle.all_reduce_replicas([received[i] for i in ids])
        summed = rank_grads(reference, data)
        for n, p in model.named_parameters():
            assert p.ds_tensor.grad is None
            expected = summed[n] / world_size
            torch.testing.assert_close(received[p.ds_id], _my_chunk(expected, shard), msg=n)


class TestInit(DistributedTest):
    @pytest.mark.parametrize(("world_size", "shard"), [(2, 1), (4, 2)])
    def test_replicas_get_the_values_built_without_them(self, world_size: int, shard: int) -> None:
        # each rank builds, then writes after construction, with its own seed: with replicas,
        # as without, every rank ends with global rank 0's values
        rank = zcomm.get_rank()
        group, replicate = hybrid_groups(shard)
        built: list[dict[str, torch.Tensor]] = []
        for init in [
            zpartition.Init(),
            zpartition.Init(data_parallel_group=group, replicate_group=replicate),
        ]:
            torch.manual_seed(rank)
            with init:
                model = TinyGPT()
                torch.manual_seed(100 + rank)
                nn.init.normal_(model.embed.weight)  # gathered, rank 0's values kept
            built.append(_full(model))
        reference = _seeded(0)
        torch.manual_seed(100)
        nn.init.normal_(reference.embed.weight)
        for values in built:
            for n, value in values.items():
                torch.testing.assert_close(value, reference.get_parameter(n), rtol=0, atol=0)
        # trained with the same groups, it matches plain PyTorch
        handle = zpartition.partition(model, config=CONFIG, group=group, replicate_group=replicate)
        data = batches(2, 2 * world_size)
        losses = train_partitioned(model, handle.shard_parameters(), data, 0.1)
        torch.testing.assert_close(
            losses, reference_losses(reference, data, 0.1), rtol=1e-5, atol=1e-6
        )
        # the groups of a shard size (DeepSpeed's mics_shard_size, which zengine's zero.Init
        # reads from its config)
        assert zpartition.hybrid_groups(world_size) == (None, None)  # one group: plain ZeRO-3
        with pytest.raises(
            ZeroParamError, match=f"shard size 3: must divide the world of {world_size}"
        ):
            zpartition.hybrid_groups(3)

    @pytest.mark.parametrize("world_size", [2])
    def test_partition_with_other_replicas_than_init_is_refused(self, world_size: int) -> None:
        group, replicate = hybrid_groups(1)
        with zpartition.Init(data_parallel_group=group):
            model = TinyGPT()
        with pytest.raises(ZeroParamError, match="built under Init with no replicate_group"):
            zpartition.partition(model, group=group, replicate_group=replicate)


class TestBadGroups(DistributedTest):
    world_size = 4

    def test_groups_that_are_no_grid_are_named(self) -> None:
        rank = zcomm.get_rank()
        pairs = groups([[0, 1], [2, 3]])
        crossed = groups([[0, 3], [1, 2]])
        shard = pairs[rank // 2]
        cases = [
            (zcomm.new_group(), "do not make a grid of the world's 4 ranks"),
            (shard, r"must meet in this rank only, not in \[\d, \d\]"),
            (crossed[0 if rank in (0, 3) else 1], "the same index in shard groups"),
        ]
        for replicate, message in cases:
            with pytest.raises(ZeroParamError, match=message):
                zpartition.partition(TinyGPT(), group=shard, replicate_group=replicate)
            with pytest.raises(ZeroParamError, match=message):
                zpartition.Init(data_parallel_group=shard, replicate_group=replicate)
