"""Process groups: new_group, and the axis groups of a topology, built once and cached."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zcomm
from zcomm.testing import DistributedTest
from zcomm.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])


def _layout(world_size: int) -> PipeDataParallelTopology:
    return PipeDataParallelTopology(
        num_pp=2 if world_size >= 2 else 1, num_dp=max(world_size // 2, 1)
    )


class TestGroups(DistributedTest):
    @SIZES
    def test_new_group_of_even_ranks(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        evens = list(range(0, world_size, 2))
        group = zcomm.new_group(evens)
        if rank in evens:
            t = torch.tensor([float(rank)])
            zcomm.all_reduce(t, group=group)
            assert t.item() == sum(evens)
            assert zcomm.get_world_size(group) == len(evens)
        else:  # outside the group a call is a mistake that names the rank, not a no-op
            t = torch.zeros(2)
            for call in (
                lambda: zcomm.all_reduce(t, group=group),
                lambda: zcomm.irecv(t, 0, group=group),
                lambda: zcomm.barrier(group=group),
            ):
                with pytest.raises(ValueError, match=f"rank {rank} is not in this group"):
                    call()

    @SIZES
    def test_axis_groups_reduce_along_their_axis(self, world_size: int) -> None:
        topo = _layout(world_size)
        coord = topo.get_coord(zcomm.get_rank())
        for axis in ("pipe", "data"):
            group = zcomm.get_axis_group(topo, axis)
            t = torch.tensor([float(zcomm.get_rank())])
            zcomm.all_reduce(t, group=group)
            peers = topo.filter_match(
                **{a: getattr(coord, a) for a in topo.get_axis_names() if a != axis}
            )
            assert t.item() == sum(peers)

    @SIZES
    def test_axis_groups_are_cached_until_destroy(self, world_size: int, tmp_path: Path) -> None:
        topo = _layout(world_size)
        group = zcomm.get_axis_group(topo, "data")
        assert zcomm.get_axis_group(_layout(world_size), "data") is group
        grid = PipelineParallelGrid(topology=topo)
        assert grid.get_data_parallel_group() is group  # the grid reuses the cached groups
        rank = zcomm.get_rank()
        zcomm.destroy()
        # A new world (a file rendezvous: the harness's port belonged to the old one).
        url = f"file://{tmp_path}/rendezvous"
        zcomm.init_distributed(init_method=url, rank=rank, world_size=world_size)
        assert zcomm.get_axis_group(topo, "data") is not group

    @SIZES
    def test_grid_with_default_topology(self, world_size: int) -> None:
        grid = PipelineParallelGrid()
        assert (
            grid.get_pipe_parallel_world_size() * grid.get_data_parallel_world_size() == world_size
        )
        assert grid.p2p_groups[zcomm.get_rank()][0] == zcomm.get_rank()
        assert grid.get_slice_parallel_world_size() == 1
        assert grid.get_slice_parallel_rank() == 0

    @pytest.mark.parametrize("world_size", [4])
    def test_grid_with_model_axis(self, world_size: int) -> None:
        topo = PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2)
        grid = PipelineParallelGrid(topology=topo)
        rank = zcomm.get_rank()
        assert grid.slice_group == topo.filter_match(data=topo.get_coord(rank).data)
        t = torch.ones(1)
        zcomm.all_reduce(t, group=grid.get_slice_parallel_group())
        assert t.item() == 2
        assert grid.get_model_parallel_world_size() == 2

    @SIZES
    def test_bad_groups_name_the_argument(self, world_size: int) -> None:
        with pytest.raises(ValueError, match=r"new_group\(ranks=\.\.\.\): 9 is not a rank"):
            zcomm.new_group([0, 9])
        with pytest.raises(ValueError, match="ranks repeat"):
            zcomm.new_group([0, 0])
        with pytest.raises(ValueError, match=r"axis='model'"):
            zcomm.get_axis_group(_layout(world_size), "model")
        with pytest.raises(ValueError, match="lays out 8 ranks"):
            PipelineParallelGrid(topology=ProcessTopology(axes=["pipe", "data"], dims=[2, 4]))
