"""Backward passes that hold their gradients (DeepSpeed's ``coalesce_grad_reduction()`` at
stages 1-3): one reduction per accumulation, at its end, and nothing across the nodes before
it; parity with plain PyTorch; misuse named as DeepSpeed names it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest

from ._helpers import LR, TinyGPT, engine_config, global_batches, plain_losses

MICRO = 4  # micro-batches per optimizer step


def _engine(stage: int, **zero: Any) -> tuple[zengine.Engine, TinyGPT]:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    cfg = engine_config(stage)  # one accumulation step: the micro-batches are the user's
    cfg["zero_optimization"] |= zero
    engine, *_ = zengine.initialize(model=model, config=cfg)
    return engine, reference


def _step(engine: zengine.Engine, tokens: torch.Tensor) -> float:
    """One optimizer step over `MICRO` micro-batches of this rank's slice of `tokens` inside
    ``coalesce_grad_reduction``, as DeepSpeed's tests run it; the global mean loss."""
    world, rank = zcomm.get_world_size(), zcomm.get_rank()
    pieces = tokens.view(MICRO, world, -1, tokens.shape[-1])
    total = torch.zeros(())
    with engine.coalesce_grad_reduction():
        for k in range(MICRO):
            loss = engine(pieces[k, rank])
            engine.set_gradient_accumulation_boundary(k == MICRO - 1)
            engine.backward(loss / MICRO)
            total += loss.detach()
    engine.step()
    zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG)
    return total.item() / MICRO


class TestParity(DistributedTest):
    world_size = 4

    # stage 3 plain, hybrid (shard within the node) and with node-local accumulation
    @pytest.mark.parametrize(
        ("stage", "zero"),
        [
            (1, {}),
            (2, {}),
            (3, {}),
            (3, {"mics_shard_size": "node"}),
            (3, {"node_local_accumulation": True}),
        ],
    )
    def test_losses_are_plain_pytorchs(self, stage: int, zero: dict[str, Any]) -> None:
        zcomm.set_node_layout(2)  # 4 ranks as 2 nodes x 2
        engine, reference = _engine(stage, **zero)
        data = global_batches(3, 2 * MICRO * 4)
        losses = [_step(engine, tokens) for tokens in data]
        torch.testing.assert_close(losses, plain_losses(reference, data, lr=LR), rtol=1e-5, atol=0)


class TestTraffic(DistributedTest):
    world_size = 4

    @pytest.mark.parametrize("stage", [2, 3])
    def test_held_passes_reduce_nothing_and_leaving_reduces_once(self, stage: int) -> None:
        zcomm.set_node_layout(2)
        engine, _ = _engine(stage)
        rank, (tokens,) = zcomm.get_rank(), global_batches(1, 2 * MICRO * 4)
        pieces = tokens.view(MICRO, 4, -1, tokens.shape[-1])

        def reduced() -> int:
            summary = zcomm.comm_summary()
            found = summary.get("reduce_scatter_tensor") or summary.get("all_reduce")
            zcomm.reset_comm_accounting()
            return 0 if found is None else found.inter_node_bytes

        zcomm.enable_comm_accounting()
        zcomm.reset_comm_accounting()
        try:
            crossed = []
            with engine.coalesce_grad_reduction():
                for k in range(MICRO):
                    engine.set_gradient_accumulation_boundary(k == MICRO - 1)
                    engine.backward(engine(pieces[k, rank]))
                    crossed.append(reduced())
            leaving = reduced()
        finally:
            zcomm.enable_comm_accounting(False)
        # stage 3's forward and backward all-gathers cross the nodes as ever; its gradients,
        # as stage 2's, cross them as the block is left only, every one once (fp32)
        numels: list[int] = [p.ds_numel if stage == 3 else p.numel() for p in engine.parameters()]
        assert crossed == [0] * MICRO
        assert leaving >= 4 * sum(numels)
        engine.step()


class TestMisuse(DistributedTest):
    world_size = 1

    def test_coalescing_is_refused_where_it_cannot_be_and_names_the_problem(self) -> None:
        engine, _ = _engine(0)
        with pytest.raises(NotImplementedError, match="requires ZeRO stage 1/2/3, got stage 0"):
            engine.coalesce_grad_reduction().__enter__()
        engine, _ = _engine(3)
        with engine.coalesce_grad_reduction():
            engine.backward(engine(global_batches(1, 2)[0]))
            with pytest.raises(AssertionError, match=r"illegal to call Engine\.step\(\) inside"):
                engine.step()
        engine.step()
        engine, _ = _engine(1)  # no_sync is stage 0's and 1's, as DeepSpeed's
        nested = pytest.raises(RuntimeError, match="cannot be nested inside another no_sync")
        with engine.coalesce_grad_reduction(), nested:
            engine.no_sync().__enter__()
        nested = pytest.raises(RuntimeError, match="coalesce_grad_reduction cannot be nested")
        with engine.no_sync(), nested:
            engine.coalesce_grad_reduction().__enter__()
        engine.pipeline_parallelism = True  # DeepSpeed's flag, which its tests set by hand
        with pytest.raises(NotImplementedError, match="not supported under pipeline parallelism"):
            engine.coalesce_grad_reduction().__enter__()
