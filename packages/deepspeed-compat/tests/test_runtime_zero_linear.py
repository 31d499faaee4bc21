"""``deepspeed.runtime.zero.linear``: DeepSpeed's ZeRO-3 linear names are torch's own linear,
and zpartition gathers around it: a model written with them trains at ZeRO-3 as plain
PyTorch does."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero import linear
from deepspeed.runtime.zero.linear import (
    LinearFunctionForZeroStage3,
    LinearModuleForZeroStage3,
    zero3_linear_wrap,
)
from unit.common import DistributedTest


def test_the_names_are_torchs_linear() -> None:
    assert LinearModuleForZeroStage3 is nn.Linear
    x, w, b = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4), torch.randn(5)
    out = zero3_linear_wrap(x, w, b)
    assert torch.equal(out, nn.functional.linear(x, w, b))
    assert torch.equal(LinearFunctionForZeroStage3.apply(x, w, None), x @ w.T)
    assert type(out.grad_fn).__name__ == "AddmmBackward0"  # torch's backward, recorded as is


def test_the_autocast_decorators_are_torchs_for_the_accelerator() -> None:
    device = get_accelerator().device_name()
    for decorator, torchs in (
        (linear.autocast_custom_fwd, torch.amp.custom_fwd),
        (linear.autocast_custom_bwd, torch.amp.custom_bwd),
    ):
        assert isinstance(decorator, functools.partial)
        assert decorator.func is torchs
        assert decorator.keywords == {"device_type": device}
    assert linear.noop_decorator(len) is len


class _FunctionalLinear(nn.Module):
    """A layer that calls the function with its own parameters, as DeepSpeed's patched
    ``F.linear`` is called: zpartition's hooks gather them around the module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = LinearModuleForZeroStage3(8, 8)
        self.weight = nn.Parameter(torch.randn(4, 8) * 0.1)
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero3_linear_wrap(torch.relu(self.inner(x)), self.weight, self.bias)


class TestAtZero3(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_trains_as_plain_pytorch(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = _FunctionalLinear()
        reference = _FunctionalLinear()
        reference.load_state_dict(model.state_dict())
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
        batches = torch.randn(3, 2 * world_size, 8, generator=torch.Generator().manual_seed(1))
        for batch in batches:
            mine = batch.chunk(world_size)[dist.get_rank()]
            loss = engine(mine).square().mean()
            engine.backward(loss)
            engine.step()
            with torch.no_grad():  # the same rank's share, as DeepSpeed's loss on this rank
                assert torch.allclose(loss, reference(mine).square().mean(), atol=1e-6)
            sgd.zero_grad()
            reference(batch).square().mean().backward()
            sgd.step()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            for trained, expected in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(trained, expected, atol=1e-6, rtol=1e-5)
        engine.destroy()
