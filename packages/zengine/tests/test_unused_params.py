"""``zero_optimization.ignore_unused_parameters: false``: a step whose accumulation left a
trainable parameter without a gradient is refused on every rank, naming it, and loses nothing
(DeepSpeed's test_ignore_unused_parameters, at every stage and 1, 2 and 4 ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
from zcomm.testing import DistributedTest


class SometimesUnused(nn.Module):
    """`extra` runs on every rank (ZeRO-3 gathers it on all alike), but takes part in the loss
    only when the forward is told so."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, with_extra: bool) -> torch.Tensor:
        y = self.used(x)
        z = self.extra(y)
        return (z if with_extra else y).square().mean()


def _engine(stage: int, ignore: bool | None, accumulation: int = 1) -> Any:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if ignore is not None:
        zero["ignore_unused_parameters"] = ignore
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero,
    }
    torch.manual_seed(0)
    engine, *_ = zengine.initialize(model=SometimesUnused(), config=config)
    return engine


def _weights(engine: Any) -> list[torch.Tensor]:
    with zengine.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


class TestIgnoreUnusedParameters(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_false_refuses_a_step_that_left_a_parameter_without_gradient(
        self, world_size: int, stage: int
    ) -> None:
        # only the last rank leaves `extra` out: every rank must raise, none hang (ZeRO-3's
        # backward needs every rank's graph alike: there every rank leaves it out)
        last = stage == 3 or zcomm.get_rank() == world_size - 1
        engine = _engine(stage, ignore=False)
        before = _weights(engine)
        engine.backward(engine(torch.randn(2, 4), with_extra=not last))
        with pytest.raises(AssertionError, match="ignore_unused_parameters") as error:
            engine.step()
        if last:
            assert "2 trainable parameters had none: 'extra.weight', 'extra.bias'" in str(
                error.value
            )
        else:
            assert "another rank did not" in str(error.value)
        assert isinstance(error.value, RuntimeError)
        # nothing was counted or stepped
        assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (0, 0, 0)
        for a, b in zip(before, _weights(engine), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        engine.destroy()

    @pytest.mark.parametrize("world_size", [2])
    @pytest.mark.parametrize("stage", [1, 3])
    def test_a_gradient_in_any_micro_batch_of_the_step_is_enough(
        self, world_size: int, stage: int
    ) -> None:
        engine = _engine(stage, ignore=False, accumulation=2)
        for step in range(2):
            for micro in range(2):
                engine.backward(engine(torch.randn(2, 4), with_extra=micro == step))
                engine.step()
        assert engine.global_steps == 2
        # the next step starts from nothing seen: the parameter must be used again
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 4), with_extra=False))
            if not engine.is_gradient_accumulation_boundary():
                engine.step()
        with pytest.raises(AssertionError, match=r"'extra\.weight'"):
            engine.step()
        engine.destroy()

    @pytest.mark.parametrize("world_size", [2])
    @pytest.mark.parametrize("ignore", [None, True])
    def test_true_and_the_default_step_over_unused_parameters(
        self, world_size: int, ignore: bool | None
    ) -> None:
        engine = _engine(2, ignore=ignore)
        assert engine._unused is None  # no hooks are put on for the default
        engine.backward(engine(torch.randn(2, 4), with_extra=False))
        engine.step()
        assert engine.global_steps == 1
        engine.destroy()
