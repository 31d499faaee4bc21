"""fp16's dynamic loss scale moves at the steps DeepSpeed moves it, at every ZeRO stage (marked
``deepspeed``: ``nox -s interop`` runs it beside DeepSpeed 0.19.8 from PyPI).

Both engines train the same model on the same batches with overflows forced by an infinite
loss on one rank; the scale after each step must be the same sequence. A scaler that raised one
clean step early or late would still give the same losses until the first overflow, which is
why loss comparisons alone did not catch it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest

from ._deepspeed_groups import forget_deepspeed_groups

deepspeed = pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed

# an overflow at steps 3, 4 and 9: lowering twice in a row, then raises after clean windows
OVERFLOWS = [False, False, False, True, True, False, False, False, False, True, False, False]


def _config(stage: int) -> dict[str, Any]:
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    fp16 |= {"loss_scale_window": 2, "hysteresis": 1, "min_loss_scale": 1}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "fp16": fp16,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }


def _scales(initialize: Any, stage: int) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    eng, optimizer, *_ = initialize(
        model=model, model_parameters=list(model.parameters()), config=_config(stage)
    )
    generator = torch.Generator().manual_seed(zcomm.get_rank())
    scales = []
    for overflow in OVERFLOWS:
        x = torch.randn(2, 8, generator=generator).half()
        loss = eng(x).float().pow(2).mean()
        eng.backward(loss * float("inf") if overflow and zcomm.get_rank() == 0 else loss)
        eng.step()
        scales.append(float(optimizer.loss_scale))  # DeepSpeed: at every stage
    return scales


class TestLossScale(DistributedTest):
    """Every stage, one after the other in the same ranks and process group."""

    world_size = 2

    def test_loss_scale_follows_deepspeeds(self) -> None:
        forget_deepspeed_groups()
        for stage in range(4):
            theirs = _scales(deepspeed.initialize, stage)
            ours = _scales(zengine.initialize, stage)
            assert ours == theirs, f"stage {stage}: zengine {ours}, DeepSpeed {theirs}"
            assert len(set(theirs)) > 2, theirs  # the scale did go down and up
