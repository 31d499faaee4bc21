"""Gradients reduced in buckets during backward at stages 0-2, and at stage 2 each rank
keeping only its partition of them ([Note: gradient buckets] in zengine/_optim/_grad_buckets.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
from zcomm.testing import DistributedTest

from ._helpers import run_with_plain

SMALL_BUCKETS = 3000  # elements: TinyGPT's groups go in many buckets, some one parameter big


class TestBuckets(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize(("stage", "overlap"), [(0, True), (1, True), (2, True), (2, False)])
    def test_small_buckets_match_plain_pytorch(
        self, world_size: int, stage: int, overlap: bool
    ) -> None:
        # with accumulation: stages 0 and 1 reduce in the last micro-batch's backward only
        zero = {"stage": stage, "reduce_bucket_size": SMALL_BUCKETS, "overlap_comm": overlap}
        losses, expected = run_with_plain(
            stage, world_size, steps=5, micro=1, accumulation=2, zero_optimization=zero
        )
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)

    @pytest.mark.parametrize("world_size", [2])
    def test_no_full_gradient_is_kept(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        config = _config(stage=2, reduce_bucket_size=50)
        engine, *_ = zengine.initialize(model=model, config=config)
        loss = engine(torch.randn(2, 8)).square().mean()
        engine.backward(loss)
        assert all(p.grad is None for p in model.parameters())  # dropped into the buckets
        assert engine.optimizer.layout.grad_flats == []
        mine = engine.optimizer.partitions.grad_partitions_flat_buffer
        total = sum(p.numel() for p in model.parameters())
        assert mine.numel() == -(-total // world_size)  # this rank's share, padded
        assert bool(mine.ne(0).any())
        engine.step()
        engine.destroy()  # the hooks come off: plain PyTorch keeps its gradients again
        model(torch.randn(2, 8)).square().mean().backward()
        assert all(p.grad is not None for p in model.parameters())

    @pytest.mark.parametrize("world_size", [2])
    def test_at_most_two_buckets_are_alive_during_backward(self, world_size: int) -> None:
        # stage 2, small buckets, overlap: a bucket is landed once the next one is started
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
        config = _config(stage=2, reduce_bucket_size=300)
        engine, *_ = zengine.initialize(model=model, config=config)
        buckets = engine.optimizer.layout.buckets
        assert len(buckets._order) >= 6
        alive: list[int] = []
        for p in model.parameters():  # after the engine's own hooks
            p.register_post_accumulate_grad_hook(
                lambda _: alive.append(sum(b.buffer is not None for b in buckets._order))
            )
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 16)).square().mean())
            engine.step()
        assert max(alive) == 2  # one reduced while the next fills; every bucket is used
        engine.destroy()


class Branchy(nn.Module):
    """Rank 1 skips the middle layer: its gradient comes from rank 0 alone."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.middle = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.last = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if zcomm.get_rank() == 0:
            x = self.middle(x)
        return self.last(self.frozen(x)).square().mean()


def _config(stage: int, **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, **zero},
    }


class TestUnusedParameters(DistributedTest):
    world_size = 2

    def test_a_parameter_unused_on_one_rank_reduces_as_at_stage_1(self) -> None:
        # stage 1 reduces a flat buffer holding zeros for what a rank did not use: the
        # reference for what stage 2's buckets must give, bucket by bucket
        results = []
        small = {"reduce_bucket_size": 40, "overlap_comm": True}  # all-reduced buckets
        for stage, zero in [(1, {}), (2, small), (2, {})]:  # the default: one reduce-scatter
            torch.manual_seed(0)
            model = Branchy()
            engine, *_ = zengine.initialize(model=model, config=_config(stage, **zero))
            g = torch.Generator().manual_seed(1 + zcomm.get_rank())
            for _ in range(3):
                engine.backward(engine(torch.randn(2, 8, generator=g)))
                engine.step()
            results.append([zengine.safe_get_full_fp32_param(p) for p in model.parameters()])
        for at_stage_1, *at_stage_2 in zip(*results, strict=True):
            for value in at_stage_2:
                torch.testing.assert_close(value, at_stage_1, rtol=1e-6, atol=1e-7)


class OneWeight(nn.Module):
    """loss = w * x: the gradient of w is x, whatever w is."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x).float().sum()


class TestCommunicationDtype(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_bf16_gradients_summed_in_fp32_keep_what_bf16_rounds_away(self, stage: int) -> None:
        # rank 0's gradient is 1, rank 1's 2**-9: their bf16 sum rounds to 1 (8 significant
        # bits), their fp32 sum does not
        x = torch.tensor([[1.0 if zcomm.get_rank() == 0 else 2.0**-9]])
        found = {}
        for comm in (None, "fp32"):
            config = {
                "train_micro_batch_size_per_gpu": 1,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            }
            if stage == 3:  # its gradient partitions are bf16 by default: would round it again
                config["data_types"] = {"grad_accum_dtype": "fp32"}
            if comm is not None:
                config["communication_data_type"] = comm
            torch.manual_seed(0)
            model = OneWeight()
            engine, *_ = zengine.initialize(model=model, config=config)
            engine.backward(engine(x.bfloat16()))
            grad = zengine.safe_get_full_grad(model.w.weight)
            assert grad is not None
            found[comm] = grad.item()
            engine.step()
        assert found[None] == 0.5  # DeepSpeed's default: reduced in bf16
        assert found["fp32"] == (1.0 + 2.0**-9) / 2, (stage, found)


def _accumulated_grad(stage: int, accumulate: str | None, comm: str | None) -> float:
    """The gradient of `OneWeight`'s weight after 4 bf16 micro-batches whose gradients are
    1/4 and 3 times 2**-11: their bf16 running sum rounds each 2**-11 away (8 significant
    bits), their fp32 sum does not."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if accumulate is not None:
        config["data_types"] = {"grad_accum_dtype": accumulate}
    if comm is not None:
        config["communication_data_type"] = comm
    torch.manual_seed(0)
    model = OneWeight()
    engine, *_ = zengine.initialize(model=model, config=config)
    for x in (1.0, 2.0**-9, 2.0**-9, 2.0**-9):  # the loss is divided by the 4 steps
        engine.backward(engine(torch.tensor([[x]]).bfloat16()))
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # a no-op between boundaries
    grad = zengine.safe_get_full_grad(model.w.weight)
    assert grad is not None
    engine.step()
    engine.destroy()
    return grad.item()


class TestAccumulationDtype(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_grad_accum_dtype_fp32_keeps_what_bf16_accumulation_rounds_away(
        self, world_size: int
    ) -> None:
        exact, once = (1 + 3 * 2.0**-9) / 4, (1 + 2.0**-7) / 4  # once: the sum rounded to bf16
        found = {
            # DeepSpeed's defaults: fp32 without ZeRO (its BF16_Optimizer), reduced in bf16
            (0, None, None): once,
            (1, None, None): 0.25,
            (0, "bf16", None): 0.25,
            (0, "fp32", "fp32"): exact,
            (1, "fp32", None): once,
            (1, "fp32", "fp32"): exact,
            # stage 2 reduces every micro-batch and adds into fp32 partitions; stage 3 as asked
            (2, None, None): exact,
            (2, "fp32", None): exact,
            (3, "fp32", None): exact,
            (3, None, None): 0.25,
        }
        for (stage, accumulate, comm), expected in found.items():
            got = _accumulated_grad(stage, accumulate, comm)
            assert got == expected, (stage, accumulate, comm, got)

    @pytest.mark.parametrize("world_size", [2])
    def test_grads_between_micro_batches_are_folded_and_dropped(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        config = {
            **_config(stage=1, reduce_bucket_size=50),
            "gradient_accumulation_steps": 2,
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "fp32"},
        }
        engine, *_ = zengine.initialize(model=model, config=config)
        layout = engine.optimizer.layout
        assert [f.dtype for f in layout.grad_flats] == [torch.float32]
        assert [f.dtype for f in layout.low_grad_flats] == [torch.bfloat16]
        engine.backward(engine(torch.randn(2, 8).bfloat16()).float().square().mean())
        assert all(p.grad is None for p in model.parameters())  # folded into fp32, as DeepSpeed
        assert not bool(layout.low_grad_flats[0].any())
        folded = layout.grad_flats[0].clone()
        assert bool(folded.any())
        engine.step()
        engine.backward(engine(torch.randn(2, 8).bfloat16()).float().square().mean())
        assert not bool(layout.grad_flats[0].any())  # reduced into the partitions, zeroed
        engine.step()
