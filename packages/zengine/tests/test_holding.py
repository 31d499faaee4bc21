"""Backward passes that hold their gradients (``no_sync()`` at every stage, DeepSpeed's
``coalesce_grad_reduction()``): one reduction per accumulation, at its end, and nothing across
the nodes before it; parity with plain PyTorch; misuse named."""

from __future__ import annotations

import contextlib
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


def _step(engine: zengine.Engine, tokens: torch.Tensor, how: str) -> float:
    """One optimizer step over `MICRO` micro-batches of this rank's slice of `tokens`, the
    first ones held by `how` ("no_sync": DDP's and Accelerate's use; "coalesce": DeepSpeed's
    ``coalesce_grad_reduction`` around them all); the global mean loss."""
    world, rank = zcomm.get_world_size(), zcomm.get_rank()
    pieces = tokens.view(MICRO, world, -1, tokens.shape[-1])
    total = torch.zeros(())
    block = engine.coalesce_grad_reduction() if how == "coalesce" else contextlib.nullcontext()
    with block:
        for k in range(MICRO):
            last = k == MICRO - 1
            held = engine.no_sync() if how == "no_sync" and not last else contextlib.nullcontext()
            with held:
                loss = engine(pieces[k, rank])
                engine.set_gradient_accumulation_boundary(last)
                engine.backward(loss / MICRO)
            total += loss.detach()
    engine.step()
    zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG)
    return total.item() / MICRO


class TestParity(DistributedTest):
    world_size = 4

    @pytest.mark.parametrize(
        ("stage", "how", "shard_size"),
        [
            (1, "coalesce", -1),
            (2, "no_sync", -1),
            (2, "coalesce", -1),
            (3, "no_sync", -1),
            (3, "coalesce", "node"),
            (3, "no_sync", "node"),
        ],
    )
    def test_losses_are_plain_pytorchs(self, stage: int, how: str, shard_size: int | str) -> None:
        zcomm.set_node_layout(2)  # 4 ranks as 2 nodes x 2
        zero = {"mics_shard_size": shard_size} if stage == 3 else {}
        engine, reference = _engine(stage, **zero)
        data = global_batches(3, 2 * MICRO * 4)
        losses = [_step(engine, tokens, how) for tokens in data]
        torch.testing.assert_close(losses, plain_losses(reference, data, lr=LR), rtol=1e-5, atol=0)


class TestTraffic(DistributedTest):
    world_size = 4

    @pytest.mark.parametrize("stage", [2, 3])
    def test_held_passes_reduce_nothing_and_the_last_reduces_once(self, stage: int) -> None:
        zcomm.set_node_layout(2)
        engine, _ = _engine(stage)
        rank, (tokens,) = zcomm.get_rank(), global_batches(1, 2 * MICRO * 4)
        pieces = tokens.view(MICRO, 4, -1, tokens.shape[-1])
        zcomm.enable_comm_accounting()
        try:
            crossed = []
            for k in range(MICRO):
                zcomm.reset_comm_accounting()
                held = engine.no_sync() if k < MICRO - 1 else contextlib.nullcontext()
                with held:
                    engine.backward(engine(pieces[k, rank]))
                summary = zcomm.comm_summary()
                reduced = summary.get("reduce_scatter_tensor") or summary.get("all_reduce")
                crossed.append(0 if reduced is None else reduced.inter_node_bytes)
        finally:
            zcomm.enable_comm_accounting(False)
        # stage 3's forward and backward all-gathers cross the nodes as ever; its gradients,
        # as stage 2's, cross them in the last backward only, every one once (fp32)
        numels: list[int] = [p.ds_numel if stage == 3 else p.numel() for p in engine.parameters()]
        trainable = sum(numels)
        assert crossed[:-1] == [0] * (MICRO - 1)
        assert crossed[-1] >= 4 * trainable
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
            with pytest.raises(RuntimeError, match="cannot be nested inside another no_sync"):
                engine.no_sync().__enter__()
        with engine.no_sync():
            with pytest.raises(RuntimeError, match="reentry is unsupported"):
                engine.no_sync().__enter__()
            with pytest.raises(RuntimeError, match="coalesce_grad_reduction cannot be nested"):
                engine.coalesce_grad_reduction().__enter__()
        engine.step()
