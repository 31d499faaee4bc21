"""A shard written through ``param.ds_tensor.data = t`` (DeepSpeed's tests, ms-swift) at ZeRO-3
is what the next step starts from, also where the engine keeps fp32 masters apart from the
shards (bf16, offloaded optimizer, tiled steps): the step must not write the old masters back."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
from zcomm.testing import DistributedTest

SIZES = (7, 5, 3)  # uneven: the last rank's shards are padded
SETUPS: dict[str, dict[str, Any]] = {
    "fp32": {},  # the fp32 shards are their own masters
    "bf16": {"bf16": {"enabled": True}},
    "bf16, offloaded optimizer": {
        "bf16": {"enabled": True},
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
    },
    "bf16, tiled step": {"bf16": {"enabled": True}, "zero_optimization": {"sub_group_size": 8}},
}


class _Scale(nn.Module):
    """loss = sum(p * x) over its parameters, one Linear-free module per parameter (a unit
    each): each parameter's gradient is its slice of x, whatever its value."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList(_Part(n) for n in SIZES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = x.split(list(SIZES))
        return sum((part(piece) for part, piece in zip(self.parts, pieces, strict=True)))


class _Part(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def _config(setup: dict[str, Any]) -> dict[str, Any]:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    zero.update(setup.get("zero_optimization", {}))
    return {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        **{k: v for k, v in setup.items() if k != "zero_optimization"},
        "zero_optimization": zero,
    }


def _written(i: int, n: int, world: int) -> torch.Tensor:
    """The whole parameter `i` once every rank filled its shard with (i + 1) * (rank + 1), as
    DeepSpeed's test writes them."""
    chunk = math.ceil(n / world)
    return torch.cat([torch.full((chunk,), float((i + 1) * (r + 1))) for r in range(world)])[:n]


def _input(rank: int) -> torch.Tensor:
    return (torch.arange(sum(SIZES)) % 5 + 1 + rank).float()


class TestShardWritesReachTheStep(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize("setup", list(SETUPS))
    def test_the_step_starts_from_what_was_written(self, world_size: int, setup: str) -> None:
        rank = zcomm.get_rank()
        engine, *_ = zengine.initialize(model=_Scale(), config=_config(SETUPS[setup]))
        dtype = next(engine.module.parameters()).dtype
        params = [part.weight for part in engine.module.parts]
        for i, p in enumerate(params):
            p.ds_tensor.data = torch.full_like(p.ds_tensor.data, (i + 1) * (rank + 1))
        loss = engine(_input(rank).to(dtype))
        engine.backward(loss)
        engine.step()  # SGD, lr 1: each parameter is what was written minus its mean gradient
        mean = sum(_input(r) for r in range(world_size)) / world_size
        grads = mean.split(list(SIZES))
        for i, (p, n, grad) in enumerate(zip(params, SIZES, grads, strict=True)):
            expected = _written(i, n, world_size) - grad  # small multiples of 1/4: exact
            master = zengine.safe_get_full_fp32_param(p)
            torch.testing.assert_close(master, expected, rtol=0, atol=0, msg=f"{setup}: {i}")
            with zengine.zero.GatheredParameters([p]):
                torch.testing.assert_close(p.data, expected.to(dtype), rtol=0, atol=0)
        engine.destroy()

    @pytest.mark.parametrize("world_size", [2])
    def test_steps_without_writes_keep_their_masters(self, world_size: int) -> None:
        """An fp32 master carries what the bf16 shard rounds away: without a write since the
        last step, the next step starts from the master, not from the shard."""
        rank = zcomm.get_rank()
        cfg = _config(SETUPS["bf16"])
        cfg["optimizer"]["params"]["lr"] = 1e-3  # steps below bf16's resolution near 1
        model = _Scale()
        with torch.no_grad():
            for weight in model.parameters():
                weight.fill_(1.0)
        engine, *_ = zengine.initialize(model=model, config=cfg)
        for _ in range(2):
            engine.backward(engine(_input(rank).to(torch.bfloat16)))
            engine.step()
        mean = sum(_input(r) for r in range(world_size)) / world_size
        params = [part.weight for part in engine.module.parts]
        for p, grad in zip(params, mean.split(list(SIZES)), strict=True):
            expected = 1.0 - 2 * 1e-3 * grad
            torch.testing.assert_close(zengine.safe_get_full_fp32_param(p), expected)
        engine.destroy()
