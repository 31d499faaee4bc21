"""GatheredParameters without modifier_rank: a change inside raises on every rank, named
([Note: discarded changes]); reads raise nothing; with modifier_rank changes are kept."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import DiscardedChangeError, GatheredParameters, ZeroParamConfig, ZeroParamError

from ._helpers import HIDDEN


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(HIDDEN, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def _partitioned(threshold: int = 0, **kwargs: Any) -> Two:
    torch.manual_seed(0)
    model = Two()
    zpartition.partition(
        model, config=ZeroParamConfig(param_persistence_threshold=threshold), **kwargs
    )
    return model


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def _raised(block: Callable[[], None]) -> dict[str, list[int]]:
    """What `block` raised on this rank: the changed parameters by name, and their ranks."""
    with pytest.raises(DiscardedChangeError, match="in-place modification") as info:
        block()
    assert "modifier_rank" in str(info.value)
    return info.value.changed


def _change(model: Two, ranks: set[int], edit: Callable[[Two], None]) -> None:
    with GatheredParameters(list(model.parameters())):
        if zcomm.get_rank() in ranks:
            edit(model)


def _scale(m: Two) -> None:
    m.l1.weight.data.mul_(2.0)  # through .data: no version counter sees it


def _bump(m: Two) -> None:
    with torch.no_grad():
        m.l2.bias.add_(1.0)  # through the parameter (DeepSpeed's test does this)


def _first_element(m: Two) -> None:
    m.l1.weight.data[0, 0] = 5.0  # element 0 lies in rank 0's chunk


def _replace(m: Two) -> None:
    m.l2.weight.data = torch.zeros(HIDDEN, HIDDEN)


class TestChangesWithoutModifier(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_a_change_on_any_rank_raises_on_every_rank(self, world_size: int) -> None:
        model = _partitioned()
        before = _values(model)
        everyone, last = set(range(world_size)), world_size - 1
        x = torch.randn(3, HIDDEN)
        expected = model(x).detach()

        cases: list[tuple[set[int], Callable[[Two], None], str]] = [
            (everyone, _scale, "l1.weight"),
            ({last}, _bump, "l2.bias"),
            ({0}, _first_element, "l1.weight"),
            (everyone, _replace, "l2.weight"),
        ]
        for who, edit, name in cases:
            changed = _raised(lambda: _change(model, who, edit))  # noqa: B023 (called at once)
            assert changed == {name: sorted(who)}, (edit.__name__, changed)
            for k, v in _values(model).items():  # dropped on every rank
                assert torch.equal(v, before[k]), (edit.__name__, k)

        # reads raise nothing: values, a state_dict, a forward pass inside the block
        with GatheredParameters(model.parameters()):
            state = {k: v.clone() for k, v in model.state_dict().items()}
            assert torch.equal(model(x), expected)
        assert torch.equal(state["l1.weight"], before["l1.weight"])

        # the block's own exception goes out as it is, change or no change
        def own_error() -> None:
            with GatheredParameters(model.l1.weight):
                model.l1.weight.data.zero_()
                raise ValueError("the block's own")

        with pytest.raises(ValueError, match="own"):
            own_error()

        # with modifier_rank the change is kept, on every rank
        with GatheredParameters(model.l1.weight, modifier_rank=last):
            if zcomm.get_rank() == last:
                model.l1.weight.data.fill_(3.0)
        assert torch.equal(_values(model)["l1.weight"], torch.full((HIDDEN, HIDDEN), 3.0))
        # ...also inside a read of the same parameters: what reached the shards is no error
        with (
            GatheredParameters(model.parameters()),
            GatheredParameters(model.l2.weight, modifier_rank=0),
            torch.no_grad(),
        ):
            model.l2.weight.fill_(4.0)
        assert torch.equal(_values(model)["l2.weight"], torch.full((HIDDEN, HIDDEN), 4.0))
        assert model(x).shape == (3, HIDDEN)

    @pytest.mark.parametrize("world_size", [2])
    def test_persistent_ranks_apart_and_disagreement(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        model = _partitioned(threshold=10**6)  # every unit persistent: never released
        x = torch.randn(3, HIDDEN)
        expected = model(x).detach()
        assert _raised(lambda: _change(model, {1}, _scale)) == {"l1.weight": [1]}
        assert torch.equal(model(x), expected)  # the persistent copy is gathered again

        # one rank's block raises its own error while the other rank's changes: each rank
        # sees its own exception, and neither waits for the other
        def own_error_on_rank_0() -> None:
            with GatheredParameters(model.l2.weight):
                if rank == 0:
                    raise KeyError("rank 0's own")
                model.l2.weight.data.add_(1.0)

        if rank == 0:
            with pytest.raises(KeyError):
                own_error_on_rank_0()
        else:
            assert _raised(own_error_on_rank_0) == {"l2.weight": [1]}
        assert torch.equal(model(x), expected)

        # rank 0 leaves its block while rank 1 gathers more inside its own: both are told
        plain = _partitioned()

        def more_on_rank_1() -> None:
            with GatheredParameters(plain.l1.weight):
                if rank == 1:
                    with GatheredParameters(plain.l2.weight):
                        pass

        with pytest.raises(ZeroParamError, match="disagree"):
            more_on_rank_1()
        assert plain(x).shape == (3, HIDDEN)  # the ranks' collectives pair again after

    @pytest.mark.parametrize("world_size", [4])
    def test_hybrid_sharding_raises_in_every_shard_group(self, world_size: int) -> None:
        group, replicate = zpartition.hybrid_groups(2)
        model = _partitioned(group=group, replicate_group=replicate)
        before = _values(model)
        changed = _raised(lambda: _change(model, {3}, _bump))
        # rank 3's shard group names it; the other shard group learns of it from its replica
        assert changed == {"l2.bias": [3] if zcomm.get_rank() >= 2 else []}
        for k, v in _values(model).items():
            assert torch.equal(v, before[k]), k
