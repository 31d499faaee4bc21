"""Backward passes without gradient sync (FSDP2's ``set_requires_gradient_sync``): full gradients
held until the accumulation's last backward, or `sync_gradients`; parity with plain PyTorch,
nothing communicated before the boundary, one reduction at it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import ZeroParamConfig

from ._helpers import (
    TinyGPT,
    batches,
    hybrid_groups,
    nodes_of,
    reference_losses,
    train_partitioned,
    window_bytes,
)

CONFIG = ZeroParamConfig(param_persistence_threshold=48)  # biases and norms in the persistent unit


def _seeded() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _partition(model: nn.Module, shard: int | None = None) -> zpartition.Partitioned:
    group, replicate = (None, None) if shard is None else hybrid_groups(shard)
    return zpartition.partition(model, config=CONFIG, group=group, replicate_group=replicate)


def _shard_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    found = {}
    for n, p in model.named_parameters():
        grad = p.ds_tensor.grad
        found[n] = torch.zeros_like(p.ds_tensor) if grad is None else grad.clone()
    return found


class TestParity(DistributedTest):
    # world 1: nothing is reduced, the switch changes nothing; (4, 2): hybrid, 2 x 2
    @pytest.mark.parametrize(("world_size", "shard"), [(1, None), (2, None), (4, None), (4, 2)])
    def test_holding_until_the_boundary_matches_plain_pytorch(
        self, world_size: int, shard: int | None
    ) -> None:
        model, reference = _seeded(), _seeded()
        handle = _partition(model, shard)
        data = batches(3, 4 * world_size)
        losses = train_partitioned(
            model,
            handle.shard_parameters(),
            data,
            0.01,
            optimizer=torch.optim.Adam,
            accumulation=4,
            handle=handle,
            hold_until_boundary=True,
        )
        expected = reference_losses(reference, data, 0.01, optimizer=torch.optim.Adam)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


def _backward(model: nn.Module, tokens: torch.Tensor) -> None:
    model(tokens).backward()


class TestTraffic(DistributedTest):
    world_size = 4

    def test_nothing_crosses_the_nodes_before_the_boundary_and_one_reduction_at_it(self) -> None:
        micro = batches(4, 2)
        with nodes_of(2):
            model = _seeded()
            handle = _partition(model)  # plain ZeRO-3 over both nodes
            inside, boundary = window_bytes(model, micro, handle.set_requires_gradient_sync)
        # the forward's and backward's all-gathers are ZeRO-3's own; no reduction before the end
        assert all("reduce_scatter_tensor" not in step for step in inside)
        # at the boundary one reduce-scatter of every trainable gradient (fp32, padded to the
        # shards), across the nodes: what one synced micro-batch moves
        padded = sum(4 * p.ds_tensor.numel() for p in model.parameters() if p.requires_grad)
        assert boundary["reduce_scatter_tensor"] == (0, 4 * padded)


class TestSyncGradients(DistributedTest):
    world_size = 2

    def test_sync_gradients_reduces_what_was_held_as_synced_passes_would(self) -> None:
        micro = batches(3, 4)
        held, synced = _seeded(), _seeded()
        held_handle, synced_handle = _partition(held), _partition(synced)
        held_handle.set_requires_gradient_sync(False)
        for tokens in micro:
            part = tokens.chunk(2)[zcomm.get_rank()]
            _backward(held, part)
            _backward(synced, part)
        assert all(p.ds_tensor.grad is None for p in held.parameters())
        held_handle.sync_gradients()
        expected = _shard_grads(synced)
        for n, grad in _shard_grads(held).items():
            torch.testing.assert_close(grad, expected[n], rtol=1e-5, atol=1e-7)
        held_handle.sync_gradients()  # nothing held any more: nothing happens
        for n, grad in _shard_grads(held).items():
            torch.testing.assert_close(grad, expected[n], rtol=1e-5, atol=1e-7)
        del synced_handle

    def test_dropped_gradients_are_never_reduced_and_a_sink_gets_the_sum_once(self) -> None:
        model = _seeded()
        handle = _partition(model)
        calls: list[int] = []

        def sink(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
            calls.append(len(params))

        handle.set_gradient_sink(sink)
        handle.set_requires_gradient_sync(False)
        tokens = batches(1, 2)[0].chunk(2)[zcomm.get_rank()]
        _backward(model, tokens)
        handle.drop_unsynced_gradients()
        handle.sync_gradients()
        assert calls == []  # dropped: nothing to reduce
        _backward(model, tokens)
        _backward(model, tokens)
        assert calls == []
        handle.set_requires_gradient_sync(True)
        _backward(model, tokens)
        trainable = sum(1 for p in model.parameters() if p.requires_grad)
        assert sum(calls) == trainable  # each parameter's reduced gradient once

    def test_a_switch_that_is_no_bool_is_named(self) -> None:
        handle = _partition(_seeded())
        with pytest.raises(TypeError, match="set_requires_gradient_sync: expected a bool"):
            handle.set_requires_gradient_sync(0)  # type: ignore[arg-type]
