"""`PipelineParallelGrid`: a topology bound to the running job, with its process groups.

DeepSpeed's grid, with its attribute and method names (the pipeline engine and Megatron-style
``mpu`` code call them). Groups come from `zcomm._groups.groups_for`, so building a second
grid over the same layout creates no new communicators.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zcomm._groups import groups_for
from zcomm._topology import PipeDataParallelTopology, ProcessTopology, _prime_factors
from zcomm._world import get_rank, get_world_size

__all__ = ["PipelineParallelGrid"]


def _default_topology(world_size: int) -> ProcessTopology:
    # DeepSpeed's split: alternate prime factors between the pipe and data axes.
    num_pp = num_dp = 1
    for i, prime in enumerate(_prime_factors(world_size)):
        if i % 2 == 0:
            num_pp *= prime
        else:
            num_dp *= prime
    return PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)


def _mine(lists: list[list[int]], rank: int) -> tuple[list[int], dist.ProcessGroup]:
    """This rank's list among `lists`, and its group (every rank builds all of them)."""
    for ranks, group in zip(lists, groups_for(lists), strict=True):
        if rank in ranks:
            return ranks, group
    raise AssertionError(f"rank {rank} is in none of {lists}")


class PipelineParallelGrid:
    """The ranks of the job on a pipe x data (x model) grid, and a process group per axis.

    ``PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=2, num_dp=2))`` on 4
    ranks gives each rank its stage (`stage_id`), its data-parallel index, its pipeline group
    (`get_pipe_parallel_group`) and its data-parallel group (`get_data_parallel_group`). All
    ranks must build the grid together (it creates process groups).
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        self.global_rank = get_rank()
        self.world_size = get_world_size()
        self._topo = topology if topology is not None else _default_topology(self.world_size)
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        if not self._is_grid_valid():
            raise ValueError(
                f"PipelineParallelGrid(topology=...): {self._topo!r} lays out "
                f"{self._topo.world_size()} ranks, but the world has {self.world_size}"
            )
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self._build_groups()
        self.p2p_groups = self.build_p2p_groups()

    def _build_groups(self) -> None:
        topo, me = self._topo, self.global_rank
        # Everything but data parallelism: the ranks that hold one replica of the model.
        model_lists = [
            sorted(topo.get_axis_list("data", i)) for i in range(self.data_parallel_size)
        ]
        if "data" not in topo.get_axis_names():
            model_lists = [list(range(self.world_size))]
        ranks, self.ds_model_proc_group = _mine(model_lists, me)
        self.ds_model_world_size = len(ranks)
        self.ds_model_rank = ranks.index(me)
        self.dp_groups = topo.get_axis_comm_lists("data") or [[r] for r in range(self.world_size)]
        self.dp_group, self.dp_proc_group = _mine(self.dp_groups, me)
        self.pipe_groups = topo.get_axis_comm_lists("pipe") or [[r] for r in range(self.world_size)]
        self.pp_group, self.pp_proc_group = _mine(self.pipe_groups, me)
        self.model_groups = topo.get_axis_comm_lists("model") or [
            [r] for r in range(self.world_size)
        ]
        self.slice_group, self.slice_proc_group = _mine(self.model_groups, me)

    def _coord_of(self, axis: str) -> int:
        return int(getattr(self._topo.get_coord(self.global_rank), axis, 0))

    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self._coord_of("pipe")

    def get_data_parallel_id(self) -> int:
        """This rank's index along the data axis."""
        return self._coord_of("data")

    def build_p2p_groups(self) -> list[list[int]]:
        """For every rank, ``[rank, next stage's rank]`` in its pipeline (wrapping around)."""
        pairs = []
        for rank in range(self.world_size):
            pipeline = next(p for p in self.pipe_groups if rank in p)
            nxt = pipeline[(pipeline.index(rank) + 1) % len(pipeline)]
            pairs.append([rank, nxt])
        return pairs

    def _is_grid_valid(self) -> bool:
        return self._topo.world_size() == get_world_size()

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of `stage_id` in this rank's pipeline (other axes from `kwargs`)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self) -> ProcessTopology:
        """The topology the grid was built from."""
        return self._topo

    # The "mpu" interface DeepSpeed and Megatron code call.
    def get_global_rank(self) -> int:
        """This process's global rank."""
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        """The stage of the pipeline this rank is in."""
        return self.get_stage_id()

    def get_pipe_parallel_world_size(self) -> int:
        """The number of pipeline stages."""
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's pipeline (one per stage)."""
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        """This rank's index among its data-parallel peers."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """The number of data-parallel replicas."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        """The ranks holding the same stage (and model slice) in every replica."""
        return self.dp_proc_group

    def get_model_parallel_rank(self) -> int:
        """This rank's index in its model replica (all pipe and model ranks of it)."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        """The number of ranks holding one replica of the model."""
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        """The ranks holding one replica of the model."""
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        """This rank's index along the model (tensor-slicing) axis; 0 without one."""
        return self._coord_of("model")

    def get_slice_parallel_world_size(self) -> int:
        """The number of tensor slices."""
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> dist.ProcessGroup:
        """The ranks sharing this rank's tensor slices."""
        return self.slice_proc_group
