"""Hybrid sharding's groups (``zero_optimization.mics_shard_size``): shard within, replicate
across.

The world is cut into shard groups of consecutive ranks (`zpartition.hybrid_groups`, which
`zero.Init` uses on the same config, so a model built under it is sharded alike), and each
rank's replicate group holds the ranks with its index in every shard group. zpartition shards the
model within the shard group and holds its gradients there; the ZeRO optimizer all-reduces its
gradient partition across the replicate group once per step ([Note: hybrid sharding] in
zpartition/_hybrid.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

import zcomm
import zpartition
from zengine._config import ConfigError, EngineConfig

__all__ = ["HybridGroups", "hybrid_groups"]

_KEY = "zero_optimization.mics_shard_size"


class HybridGroups(NamedTuple):
    shard: dist.ProcessGroup | None  # None: the world (no hybrid sharding)
    replicate: dist.ProcessGroup | None  # None: no replicas


def hybrid_groups(cfg: EngineConfig, group: dist.ProcessGroup | None) -> HybridGroups:
    """This rank's shard and replicate groups for `cfg` over the data-parallel `group` (None:
    the world). Collective on first use (every rank builds every group, cached by zcomm)."""
    zero = cfg.zero_optimization
    _check_secondary(cfg)
    wanted = zero.mics_shard_size
    if wanted == -1 and not zero.mics_hierarchical_params_gather:
        return HybridGroups(group, None)
    problems = []
    if cfg.zero_stage != 3:
        problems.append(
            f"{_KEY}: hybrid sharding is ZeRO stage 3's; this config runs stage {cfg.zero_stage}"
        )
    if group is not None and group is not dist.group.WORLD:
        problems.append(
            f"{_KEY}: hybrid sharding cuts the whole world into shard groups; it "
            "cannot be combined with an mpu's data-parallel group"
        )
    if problems:
        raise ConfigError(problems)
    world = dist.get_world_size()
    layout = None
    if wanted == "node" or zero.mics_hierarchical_params_gather:
        layout = zcomm.node_layout()  # collective the first time: every rank asks alike
    if wanted == "node":
        assert layout is not None
        size = layout.ranks_per_node
    else:
        size = world if wanted == -1 else int(wanted)
    if world % size:
        raise ConfigError(
            [
                f"{_KEY}: {size} does not divide the world of {world} ranks (shard groups must "
                "be of equal size; their number is the replicas of each shard)"
            ]
        )
    if layout is not None and zero.mics_hierarchical_params_gather:
        _check_within_nodes(layout, size, world)
    shard, replicate = zpartition.hybrid_groups(size)  # what zero.Init makes of the config
    return HybridGroups(group if shard is None else shard, replicate)


def _check_secondary(cfg: EngineConfig) -> None:
    """``zero_hpz_partition_size``: stage 3's, and a divisor of a node's ranks (zpartition
    checks the rest: that it divides the shard group, with its groups inside nodes)."""
    size = cfg.zero_optimization.zero_hpz_partition_size
    if size == 1:
        return
    key = "zero_optimization.zero_hpz_partition_size"
    if cfg.zero_stage != 3:
        raise ConfigError(
            [f"{key}: ZeRO++'s hpZ is stage 3's; this config runs stage {cfg.zero_stage}"]
        )
    per_node = zcomm.node_layout().ranks_per_node  # collective the first time, as above
    if per_node % size:
        raise ConfigError(
            [
                f"{key}: {size} must divide a node's {per_node} ranks (the "
                "secondary shards are gathered within a node)"
            ]
        )


def _check_within_nodes(layout: zcomm.NodeLayout, size: int, world: int) -> None:
    spanning = [
        ranks
        for start in range(0, world, size)
        if layout.spans_nodes(ranks := list(range(start, start + size)))
    ]
    if spanning:
        raise ConfigError(
            [
                "zero_optimization.mics_hierarchical_params_gather: true asks for a two-level "
                f"gather of shard groups that span nodes (ranks {spanning[0]}, with "
                f"{layout.ranks_per_node} ranks per node), which zstack does not build; shard "
                f'within a node ({_KEY}: "node" or at most {layout.ranks_per_node})'
            ]
        )
