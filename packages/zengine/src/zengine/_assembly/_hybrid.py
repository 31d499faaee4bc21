"""Hybrid sharding's groups (``zero_optimization.mics_shard_size``): shard within, replicate
across.

The world is cut into shard groups of consecutive ranks (`zpartition.hybrid_groups`, which
`zero.Init` uses on the same config, so a model built under it is sharded alike), and each
rank's replicate group holds the ranks with its index in every shard group. zpartition shards the
model within the shard group and holds its gradients there; the ZeRO optimizer all-reduces its
gradient partition across the replicate group once per step ([Note: hybrid sharding] in
zpartition/_hybrid.py). The other keys of stage 3's communication (hpZ, node-local
accumulation, quantized weights) are checked here too, before any group is made.
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
    _check_node_local(cfg, group)
    for key, on, what in (
        ("zero_quantized_weights", zero.zero_quantized_weights, "qwZ quantizes stage 3's gathers"),
        (
            "zero_quantized_gradients",
            zero.zero_quantized_gradients,
            "qgZ quantizes stage 3's reductions",
        ),
        (
            "zero_quantized_nontrainable_weights",
            zero.zero_quantized_nontrainable_weights,
            "MixZ++ keeps stage 3's frozen shards quantized",
        ),
    ):
        if on and cfg.zero_stage != 3:
            stage = cfg.zero_stage
            raise ConfigError(
                [f"zero_optimization.{key}: ZeRO++'s {what}; this config runs stage {stage}"]
            )
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
    try:  # zero.Init makes the same groups of the same config
        shard, replicate = zpartition.hybrid_groups(wanted)
    except zpartition.ZeroParamError as error:
        raise ConfigError([f"{_KEY}: {error}"]) from error
    if zero.mics_hierarchical_params_gather:
        world = dist.get_world_size()
        size = world if shard is None else dist.get_world_size(shard)
        _check_within_nodes(zcomm.node_layout(), size, world)
    return HybridGroups(group if shard is None else shard, replicate)


def _check_node_local(cfg: EngineConfig, group: dist.ProcessGroup | None) -> None:
    """``node_local_accumulation``: stage 3's, over the whole world, without hybrid sharding."""
    zero = cfg.zero_optimization
    if not zero.node_local_accumulation:
        return
    key = "zero_optimization.node_local_accumulation"
    problems = []
    if cfg.zero_stage != 3:
        problems.append(f"{key}: it is ZeRO stage 3's; this config runs stage {cfg.zero_stage}")
    if zero.mics_shard_size != -1:
        problems.append(
            f"{key}: not with {_KEY} {zero.mics_shard_size!r}: hybrid sharding's shard groups "
            "keep the reductions within them already, and cross the replicas once per step"
        )
    if group is not None and group is not dist.group.WORLD:
        problems.append(f"{key}: the nodes are the world's; not with an mpu's data-parallel group")
    if problems:
        raise ConfigError(problems)


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
