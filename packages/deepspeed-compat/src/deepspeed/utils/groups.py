"""``deepspeed.utils.groups``: the data-parallel group is the world (zstack shards over all
ranks); the sequence-, expert- and model-parallel groups are refused where they are asked for."""

from __future__ import annotations

import torch.distributed as dist

import zcomm
from deepspeed._refused import EXPERT_PARALLEL, SEQUENCE_PARALLEL, TENSOR_PARALLEL, refused

__all__ = [
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_model_parallel_group",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]


def _get_data_parallel_group() -> dist.ProcessGroup:
    """The group ZeRO shards over: the whole world."""
    group = dist.group.WORLD
    assert group is not None, "deepspeed.utils.groups: torch.distributed is not initialized"
    return group


def _get_data_parallel_world_size() -> int:
    return zcomm.get_world_size()


def _get_data_parallel_rank() -> int:
    return zcomm.get_rank()


_get_sequence_parallel_group = refused(
    "deepspeed.utils.groups._get_sequence_parallel_group", *SEQUENCE_PARALLEL
)
_get_sequence_parallel_world_size = refused(
    "deepspeed.utils.groups._get_sequence_parallel_world_size", *SEQUENCE_PARALLEL
)
_get_sequence_parallel_rank = refused(
    "deepspeed.utils.groups._get_sequence_parallel_rank", *SEQUENCE_PARALLEL
)
_get_expert_parallel_group = refused(
    "deepspeed.utils.groups._get_expert_parallel_group", *EXPERT_PARALLEL
)
_get_model_parallel_group = refused(
    "deepspeed.utils.groups._get_model_parallel_group", *TENSOR_PARALLEL
)
