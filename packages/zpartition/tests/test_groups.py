"""Per-group state: a group's channel (its ds_id and unit-id counters, its units) lives exactly as
long as the group, however many other groups come and go, and a torn-down world's goes with it."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch._dynamo  # imported before any world of TestWorldChannels: see there
import torch.distributed as dist
from torch import nn

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import ZeroParamConfig, ZeroParamError
from zpartition._param import zero_params

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
PER_MODULE = ZeroParamConfig(param_persistence_threshold=0)  # every parameter gathered on use


def _build(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _partitioned(
    seed: int, group: dist.ProcessGroup | None
) -> tuple[nn.Sequential, zpartition.Partitioned]:
    model = _build(seed)
    return model, zpartition.partition(model, config=PER_MODULE, group=group)


def _own_group() -> dist.ProcessGroup:
    """A group of this rank alone, made by it alone (no other rank waits for it)."""
    return dist.new_group([zcomm.get_rank()], use_local_synchronization=True)


def _ds_ids(model: nn.Module) -> set[int]:
    return {p.ds_id for p in zero_params(model.parameters())}


def _channel_of(model: nn.Module) -> object:
    param = zero_params(model.parameters())[0]
    assert param.ds_unit is not None
    return param.ds_unit.channel


def _assert_gathers_to(model: nn.Module, reference: nn.Module) -> None:
    """DeepSpeed's explicit pair, on each parameter: the full values, then empty again."""
    for p, ref in zip(zero_params(model.parameters()), reference.parameters(), strict=True):
        p.all_gather()
        torch.testing.assert_close(p.data, ref.data, rtol=0, atol=0)
        p.partition()
        assert p.numel() == 0


class TestGroupChannels(DistributedTest):
    @SIZES
    def test_a_group_keeps_its_counters_while_many_other_groups_come_and_go(
        self, world_size: int
    ) -> None:
        group = zcomm.new_group(list(range(world_size)))
        first, _ = _partitioned(0, group)
        for _ in range(70):  # more groups than any fixed bound on the registry
            other = _own_group()
            model, handle = _partitioned(1, other)
            model(torch.ones(2, 4))
            handle.remove(gather=False)
            dist.destroy_process_group(other)
        second, _ = _partitioned(2, group)
        assert _channel_of(second) is _channel_of(first)
        assert not _ds_ids(first) & _ds_ids(second)  # ids go on from where the first stopped
        _assert_gathers_to(first, _build(0))
        _assert_gathers_to(second, _build(2))
        torch.testing.assert_close(first(torch.ones(2, 4)), _build(0)(torch.ones(2, 4)))

    @SIZES
    def test_a_destroyed_groups_channel_is_freed(self, world_size: int) -> None:
        for _ in range(3):
            group = zcomm.new_group(list(range(world_size)))
            model, handle = _partitioned(0, group)
            model(torch.ones(2, 4)).sum().backward()
            handle.remove(gather=False)  # the hooks hold the model: see Partitioned.remove
            channel, kept = weakref.ref(_channel_of(model)), weakref.ref(group)
            del model, handle
            dist.destroy_process_group(group)
            del group
            gc.collect()
            assert kept() is None  # nothing here holds a destroyed group
            assert channel() is None

    @pytest.mark.parametrize("world_size", [2])
    def test_a_rank_outside_the_group_is_told_so(self, world_size: int) -> None:
        group = zcomm.new_group([0])  # rank 1 gets torch's placeholder for ranks outside
        if zcomm.get_rank() == 0:
            with zpartition.Init(data_parallel_group=group, sync_module_states=False):
                nn.Linear(2, 2)
            return
        with (
            pytest.raises(ZeroParamError, match="not in the process group"),
            zpartition.Init(data_parallel_group=group, sync_module_states=False),
        ):
            nn.Linear(2, 2)


class TestWorldChannels(DistributedTest):
    """torch keeps, for good, the world that is up when ``torch._dynamo`` is first imported
    (partition's hooks import it, through ``torch.compiler.disable``): this module imports it
    first, so the worlds here are not that one."""

    init_distributed = False  # each test starts and tears down worlds of its own

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_a_torn_down_worlds_channel_is_freed_and_a_new_world_gets_a_new_one(
        self, world_size: int, tmp_path: Path
    ) -> None:
        for attempt in range(3):
            zcomm.init_distributed(
                "gloo",
                init_method=f"file://{tmp_path / f'store{attempt}'}",
                rank=zcomm.get_local_rank(),
                world_size=world_size,
            )
            model, handle = _partitioned(attempt, None)
            assert min(_ds_ids(model)) == 0  # a fresh world counts from the start
            _assert_gathers_to(model, _build(attempt))
            handle.remove(gather=False)
            channel = weakref.ref(_channel_of(model))
            del model, handle
            zcomm.destroy()
            gc.collect()
            assert channel() is None
