"""Leaf modules at run time: gathered whole, so children may run in any order on any rank."""

from __future__ import annotations

import copy
from typing import cast

import pytest
import torch
from torch import nn

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import ZeroParamConfig

from ._helpers import TinyGPT, batches, reference_losses, train_partitioned

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])


class ChooseByRank(nn.Module):
    """Each rank runs a different expert: a collective mismatch without the leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[zcomm.get_rank() % 4](x)


class ChooseByCounter(nn.Module):
    """The order changes every step."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.experts[self.calls % 3](x)


class Moe(nn.Module):
    def __init__(self, inner: type[nn.Module]) -> None:
        super().__init__()
        self.before = nn.Linear(8, 8)
        self.moe = inner()
        self.after = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(self.moe(self.before(x))).mean()


class TestLeafModules(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("inner", [ChooseByRank, ChooseByCounter])
    def test_children_may_differ_by_rank_and_step(
        self, world_size: int, inner: type[nn.Module]
    ) -> None:
        torch.manual_seed(0)
        model = Moe(inner)
        reference = copy.deepcopy(model)
        zpartition.set_z3_leaf_modules(model, [inner])
        handle = zpartition.partition(model, config=ZeroParamConfig(param_persistence_threshold=0))
        assert {u.name for u in handle.units} == {"before", "moe", "after"}
        opt = torch.optim.SGD(handle.shard_parameters(), lr=0.1)
        for _ in range(4):
            x = torch.randn(4, 8)
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if isinstance(model.moe, ChooseByCounter):
                cast(ChooseByCounter, reference.moe).calls = model.moe.calls - 1
            ref_loss = reference(x)  # every rank's reference takes this rank's expert
            ref_loss.backward()
            assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
            params = list(reference.parameters())
            total = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in params
                ]
            )
            zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG)  # what the ranks' shards receive
            offset = 0
            with torch.no_grad():
                for p in params:
                    p.sub_(0.1 * total[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            reference.zero_grad()

    @SIZES
    @pytest.mark.parametrize("threshold", [0, 100, 12100, 10**7])
    def test_granularity_thresholds_give_the_same_losses(
        self, world_size: int, threshold: int
    ) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        config = ZeroParamConfig(
            param_persistence_threshold=0, module_granularity_threshold=threshold
        )
        handle = zpartition.partition(model, config=config)
        leaves = zpartition.get_z3_leaf_modules(model)
        assert bool(leaves) == (threshold >= 12100)
        data = batches(3, 8)
        losses = train_partitioned(model, handle.shard_parameters(), data, 0.1)
        torch.testing.assert_close(
            losses, reference_losses(reference, data, 0.1), rtol=1e-5, atol=1e-6
        )
