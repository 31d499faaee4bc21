"""Quantized gradients (ZeRO++'s qgZ): training near plain PyTorch, the reduction's bytes on
the wire a quarter of fp32's, hierarchical over nodes (only the second stage crosses them)."""

from __future__ import annotations

import pytest
import torch

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import ZeroParamConfig

from ._helpers import TinyGPT, batches, link_bytes, nodes_of, reference_losses, train_partitioned

LOSS_RTOL = 5e-3  # measured 4.2e-4 (2 ranks) and 2.4e-4 (2 x 2): room for other platforms


def _seeded() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _config(quantized: bool) -> ZeroParamConfig:
    # blocks of 256: TinyGPT's buckets are a few thousand elements, so blocks this size follow
    # each rank's chunk (a block of 2048 would be mostly padding here)
    return ZeroParamConfig(
        param_persistence_threshold=48,
        quantized_weights_block_size=256,
        quantized_gradients=quantized,
    )


def _reduction_bytes(quantized: bool, tokens: torch.Tensor) -> dict[str, tuple[int, int]]:
    model = _seeded()
    zpartition.partition(model, config=_config(quantized))
    return link_bytes(lambda: model(tokens.chunk(4)[zcomm.get_rank()]).backward())


class TestQuantizedGradients(DistributedTest):
    # 2 ranks on one node (flat), 4 as 2 nodes x 2 (hierarchical)
    @pytest.mark.parametrize(("world_size", "per_node"), [(2, 2), (4, 2)])
    def test_training_near_plain_pytorch(self, world_size: int, per_node: int) -> None:
        data = batches(4, 4 * world_size)
        expected = reference_losses(_seeded(), data, 0.1)
        with nodes_of(per_node):
            model = _seeded()
            handle = zpartition.partition(model, config=_config(True))
            losses = train_partitioned(model, handle.shard_parameters(), data, 0.1)
            exact = _seeded()
            other = zpartition.partition(exact, config=_config(False))
            unquantized = train_partitioned(exact, other.shard_parameters(), data, 0.1)
        torch.testing.assert_close(losses, expected, rtol=LOSS_RTOL, atol=0)
        assert losses != unquantized  # the reduction was quantized
        torch.testing.assert_close(unquantized, expected, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("world_size", [4])
    def test_the_bytes_on_the_wire_and_across_nodes(self, world_size: int) -> None:
        (tokens,) = batches(1, 8)
        with nodes_of(2):
            exact = _reduction_bytes(False, tokens)["reduce_scatter_tensor"]
            quantized = _reduction_bytes(True, tokens)
        assert "reduce_scatter_tensor" not in quantized  # one all-to-all per stage instead
        within, across = quantized["all_to_all_single"]
        # hierarchical: the node's all-to-all carries every chunk, quantized; the one across
        # nodes only this node's partial sums: 1/L of it (L = 2 ranks per node)
        assert across * 2 == within
        assert 0.2 < within / sum(exact) < 0.3  # int8 and a scale per 256: ~0.254 of fp32
