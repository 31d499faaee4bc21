"""Node-local accumulation (``ZeroParamConfig.node_local_accumulation``): each micro-batch's
gradients reduce-scattered within the node, across the nodes once per accumulation; parity with
plain PyTorch, the bytes per link class, DeepSpeed's reduction factors, a sink, refusals."""

from __future__ import annotations

import math
from collections.abc import Sequence

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
    hybrid_groups,
    nodes_of,
    rank_grads,
    reference_losses,
    train_partitioned,
    window_bytes,
)


def _seeded() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _config(scale: tuple[float, float] | None = None) -> ZeroParamConfig:
    return ZeroParamConfig(
        param_persistence_threshold=48, node_local_accumulation=True, reduce_scale=scale
    )


def _my_chunk(full: torch.Tensor) -> torch.Tensor:
    world = zcomm.get_world_size()
    chunk = math.ceil(full.numel() / world)
    flat = nn.functional.pad(full.reshape(-1), (0, chunk * world - full.numel()))
    return flat[zcomm.get_rank() * chunk :][:chunk]


class TestParity(DistributedTest):
    world_size = 4

    # 2 nodes x 2 ranks and 4 x 1, accumulation 4; 2 x 2 once more without accumulation
    @pytest.mark.parametrize(("per_node", "accumulation"), [(2, 4), (1, 4), (2, 1)])
    def test_losses_are_plain_pytorchs(self, per_node: int, accumulation: int) -> None:
        with nodes_of(per_node):
            model, reference = _seeded(), _seeded()
            handle = zpartition.partition(model, config=_config())
            data = batches(3, 4 * 4)
            losses = train_partitioned(
                model,
                handle.shard_parameters(),
                data,
                0.01,
                optimizer=torch.optim.Adam,
                accumulation=accumulation,
                handle=handle,  # set_requires_all_reduce on the last micro-batch only
            )
        expected = reference_losses(reference, data, 0.01, optimizer=torch.optim.Adam)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


class TestTraffic(DistributedTest):
    world_size = 4

    def test_micro_batches_reduce_in_the_node_and_the_boundary_across_once(self) -> None:
        micro = batches(4, 2)
        with nodes_of(2):
            model = _seeded()
            handle = zpartition.partition(model, config=_config())
            inside, boundary = window_bytes(model, micro, handle.set_requires_all_reduce)
        # fp32: each rank's node chunk is 2 shards (one per node) of every trainable gradient,
        # padded as the shards are, and one presence flag per gradient group
        shards = sum(p.ds_tensor.numel() for p in model.parameters() if p.requires_grad)
        flags = sum(len(u.grad_groups) for u in handle.units)
        within = 4 * 4 * shards  # the node's reduce-scatter reads the whole bucket
        for step in inside:
            assert step["reduce_scatter_tensor"] == (within, 0)
        # the boundary: the node's, then one across the nodes of 2 x (shards + flags)
        assert boundary["reduce_scatter_tensor"] == (within, 4 * 2 * (shards + flags))


class TestReductionFactors(DistributedTest):
    world_size = 4

    @pytest.mark.parametrize("mode", ["mean", "predivide", "sum"])
    def test_each_factor_is_applied_once_across_accumulation_and_boundaries(
        self, mode: str
    ) -> None:
        # DeepSpeed's options as zengine makes them: the mean, gradient_predivide_factor 2,
        # "sum"; two boundaries without zero_grad: a reduced gradient is not summed again
        scale = {"mean": None, "predivide": (0.5, 2 / 4), "sum": (1.0, 1.0)}[mode]
        data = batches(3, 2 * 4)
        with nodes_of(2):
            model, reference = _seeded(), _seeded()
            handle = zpartition.partition(model, config=_config(scale))
            for tokens, require in zip(data, [False, True, True], strict=True):
                handle.set_requires_all_reduce(require)
                model(tokens.chunk(4)[zcomm.get_rank()]).backward()
        summed = rank_grads(reference, data)
        factor = 4 if mode == "sum" else 1
        for n, p in model.named_parameters():
            expected = summed[n] / 4 * factor
            torch.testing.assert_close(p.ds_tensor.grad, _my_chunk(expected), msg=n)

    def test_a_sink_gets_the_world_reduction_at_the_boundary_only(self) -> None:
        received: dict[int, torch.Tensor] = {}
        calls: list[int] = []

        def sink(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
            calls.append(len(params))
            for p, g in zip(params, grads, strict=True):
                received[p.ds_id] = received.get(p.ds_id, torch.zeros_like(g)) + g.clone()

        data = batches(3, 2 * 4)
        with nodes_of(2):
            model, reference = _seeded(), _seeded()
            handle = zpartition.partition(model, config=_config(), gradient_sink=sink)
            for k, tokens in enumerate(data):
                handle.set_requires_all_reduce(k == len(data) - 1)
                model(tokens.chunk(4)[zcomm.get_rank()]).backward()
                assert bool(calls) == (k == len(data) - 1)
        summed = rank_grads(reference, data)
        for n, p in model.named_parameters():
            assert p.ds_tensor.grad is None
            torch.testing.assert_close(received[p.ds_id], _my_chunk(summed[n] / 4), msg=n)


class TestRefusals(DistributedTest):
    world_size = 4

    def test_with_replicas_or_less_than_the_world_it_is_named(self) -> None:
        with nodes_of(2):
            shard, replicate = hybrid_groups(2)
            with pytest.raises(ZeroParamError, match="node_local_accumulation: not with hybrid"):
                zpartition.partition(
                    _seeded(), config=_config(), group=shard, replicate_group=replicate
                )
            with pytest.raises(ZeroParamError, match="partitioned across the whole world"):
                zpartition.partition(_seeded(), config=_config(), group=shard)
            # one node: nothing crosses one, and nothing changes: every backward reduces into
            # the shards' gradients, as without the option
            zcomm.set_node_layout(4)
            model = _seeded()
            handle = zpartition.partition(model, config=_config())
            handle.set_requires_all_reduce(False)
            model(batches(1, 4)[0].chunk(4)[zcomm.get_rank()]).backward()
            assert all(p.ds_tensor.grad is not None for p in model.parameters())
