"""What ``engine.backward(loss)`` returns: the loss divided by the accumulation steps, in the
loss's own dtype (DeepSpeed's; its tests compare it with ``loss / gas`` computed by hand)."""

from __future__ import annotations

import pytest
import torch

import zengine
from zcomm.testing import DistributedTest

from ._helpers import TinyGPT, global_batches


class _LossInModelDtype(TinyGPT):
    """TinyGPT's loss in the dtype the engine computes in (TinyGPT's own is fp32)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens).to(self.embed.weight.dtype)


class TestBackwardReturns(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
    @pytest.mark.parametrize("stage", [0, 3])
    def test_the_loss_over_the_accumulation_steps_in_its_dtype(
        self, world_size: int, precision: str, stage: int
    ) -> None:
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 3,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage},
            "fp16": {"enabled": precision == "fp16"},
            "bf16": {"enabled": precision == "bf16"},
        }
        engine, *_ = zengine.initialize(model=_LossInModelDtype(), config=config)
        for tokens in global_batches(3, 2):
            loss = engine(tokens)
            returned = engine.backward(loss)
            expected = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
            assert loss.dtype == returned.dtype == expected[precision]
            # a third rounded once, to the loss's dtype: as DeepSpeed's ``loss / gas``
            assert torch.equal(returned, loss.detach() / 3)
            engine.step()
        engine.destroy()

    @pytest.mark.parametrize("world_size", [1])
    def test_without_scaling_by_the_accumulation_it_is_the_loss(self, world_size: int) -> None:
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True},
        }
        engine, *_ = zengine.initialize(model=_LossInModelDtype(), config=config)
        loss = engine(global_batches(1, 2)[0])
        returned = engine.backward(loss, scale_wrt_gas=False)
        assert returned.dtype == torch.bfloat16
        assert torch.equal(returned, loss.detach())
        engine.destroy()
