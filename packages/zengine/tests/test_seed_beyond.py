"""A seed case DeepSpeed itself skips, written out here: zengine passes it.

DeepSpeed's test_zero_context_return.py marks ``test_ext_param_returnobj`` WIP: a module that
returns a plain object holding its own parameter, which the module above it then uses (an
external parameter that torch's hooks cannot see in the output). The seed file stays as it
came, its skip included; this is the same case in this repository's own words, checked against
plain PyTorch as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import zengine
from zcomm.testing import DistributedTest
from zpartition import ZeroParamStatus

DIM = 16


@dataclass
class _Returned:
    """An output torch does not look into: neither a tensor nor a container of them."""

    out: torch.Tensor
    bias: torch.Tensor


class _ReturnsItsBias(nn.Linear):
    def forward(self, x: torch.Tensor) -> Any:  # a _Returned, which nn.Module's type omits
        return _Returned(super().forward(x), self.bias)


class _UsesTheBias(nn.Linear):
    """Hands its child's bias on: it is used above the module that owns it."""

    def __init__(self) -> None:
        super().__init__(DIM, DIM)
        self.inner = _ReturnsItsBias(DIM, DIM)

    def forward(self, x: torch.Tensor) -> Any:  # (out, bias), where Linear's type says Tensor
        returned = self.inner(super().forward(x))
        status = getattr(returned.bias, "ds_status", ZeroParamStatus.AVAILABLE)
        assert status == ZeroParamStatus.AVAILABLE  # still gathered for the caller
        return returned.out, returned.bias


class _Container(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.user = _UsesTheBias()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.user(self.linear(x))
        return (out + bias).sum()


class TestBeyondDeepSpeed(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_a_parameter_returned_inside_an_object(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = _Container()
        reference = _Container()
        reference.load_state_dict(model.state_dict())
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 10**6,
            "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1},
        }
        engine, *_ = zengine.initialize(model=model, config=config)
        plain = torch.optim.Adam(reference.parameters(), lr=1.5e-4)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.rand(DIM, generator=g)
            loss = engine(x)
            # registered on the module that used it, not on the one that returned it
            assert len(getattr(model, "_external_params", ())) == 1
            assert len(getattr(model.user, "_external_params", ())) == 0
            engine.backward(loss)
            engine.step()
            expected = reference(x)
            plain.zero_grad()
            expected.backward()
            plain.step()
            torch.testing.assert_close(loss, expected)
