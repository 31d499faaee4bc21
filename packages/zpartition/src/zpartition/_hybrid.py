"""Hybrid sharding: parameters sharded within a shard group, replicated across a replicate group.

[Note: hybrid sharding]
DeepSpeed's MiCS and FSDP2's HSDP: the world is a grid of R shard groups of S ranks each. A
model is partitioned within this rank's *shard group* (its units, channel, gathers and
reduce-scatters are the shard group's, exactly as without replicas), and each of its chunks is
held by R ranks, one per shard group: the *replicate group*, the ranks with the same index in
every shard group. Gathers never leave the shard group (the point: they stay on fast links);
only gradients cross the replicate group.

- Values: the replicas must start equal, so a parameter cut under `partition` or `Init` is
  broadcast across the replicate group (replica 0's values) and then within the shard group
  (its rank 0's): every rank then holds global rank 0's values, whatever the seeds.
  ``GatheredParameters(modifier_rank=r)`` likewise keeps replica 0's modifier's values.
- Gradients: each backward reduce-scatters within the shard group as before, but the results
  are *held* (`PartialGradients`, `_partial.py`, one buffer per reduction dtype) instead of
  added to the shards' ``.grad``. The backward that runs with ``requires_all_reduce`` (True unless
  `Partitioned.set_requires_all_reduce` said otherwise, FSDP2's switch) all-reduces what is held
  across the replicate group once, at its end, and adds it to ``.grad``. So gradient
  accumulation crosses the replicate group only at its boundary, and ``.grad`` only ever holds
  gradients reduced over every rank, as FSDP2 keeps its partial reductions apart: with
  DeepSpeed's reduction options a sum held with ``.grad`` would be summed again by the next
  all-reduce.
- Scaling: ``reduce_scale``'s factors are the whole reduction's: the pre-factor is applied once,
  before the shard group's sum (a shard group of one rank applies it too), the post-factor once,
  after the replicas' sum; sums in between. Without it, each stage averages: the mean over the
  shard group, then over the replicas, which is the mean over every rank.
- A gradient sink (an optimizer keeping its own gradients, as zengine's) gets the shard group's
  reduction, every backward: the mean over the shard group, or the pre-scaled sum. Nothing is
  held and nothing all-reduced here; the sink's owner all-reduces its accumulated gradients
  across `Partitioned.replicate_group` at its step, with `Partitioned.all_reduce_replicas`
  (the mean, or the sum times the post-factor).
- A parameter no rank of its replicate group has a gradient for keeps ``.grad`` None, as
  without replicas: each group's held gradient carries a presence flag, summed with it, so a
  replica whose forward skipped a module still joins an all-reduce of the same size.

`replicas_for` checks the groups form a grid where each rank can see it (this rank in both, the
groups meeting in this rank only, sizes multiplying to the world) and, in one small all-gather
across the replicate group, that its ranks hold the same chunk (the same index in shard groups
of the same size). A replicate group of one rank is none: ``replicate_group=None`` and it cost
nothing beyond today's partitioning.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import zcomm
from zcomm.topology import ProcessTopology
from zpartition._errors import ZeroParamError

__all__ = ["hybrid_groups", "replicas_for"]


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def hybrid_groups(
    shard_size: int | str,
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's ``(shard group, replicate group)`` when the world is cut into shard groups
    of `shard_size` consecutive ranks (DeepSpeed's ``mics_shard_size``; ``"node"``: a node's
    ranks, `zcomm.node_layout`; -1 or the world size: ``(None, None)``, plain ZeRO-3).
    Consecutive, because torchrun numbers a node's ranks so: a shard group of a node's size
    never leaves it. Every rank must call it alike the first time (it builds every group;
    zcomm caches them)."""
    world = dist.get_world_size()
    if shard_size == "node":
        shard_size = zcomm.node_layout().ranks_per_node
    if isinstance(shard_size, bool) or not isinstance(shard_size, int):
        raise ZeroParamError(f'shard size {shard_size!r}: expected a number of ranks or "node"')
    if shard_size == -1 or shard_size == world:
        return None, None
    if shard_size < 1 or world % shard_size:
        raise ZeroParamError(
            f"shard size {shard_size}: must divide the world of {world} ranks (shard groups "
            "of equal size, replicated across)"
        )
    grid = ProcessTopology(axes=["replica", "shard"], dims=[world // shard_size, shard_size])
    return zcomm.get_axis_group(grid, "shard"), zcomm.get_axis_group(grid, "replica")


def replicas_for(
    group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """`replicate_group` checked against the shard group `group` (None: the world); None when
    there is no replica to reduce with. Raises `ZeroParamError` naming what is wrong."""
    if replicate_group is None:
        return None
    me = dist.get_rank()
    where = f"rank {me}: replicate_group"
    if dist.get_rank(replicate_group) < 0:
        raise ZeroParamError(f"{where}: this rank is not in the replicate group")
    if group is not None and dist.get_rank(group) < 0:
        raise ZeroParamError(f"rank {me}: this rank is not in the process group to partition")
    shard, replicas, world = _ranks(group), _ranks(replicate_group), dist.get_world_size()
    if len(shard) * len(replicas) != world:
        raise ZeroParamError(
            f"{where}: a shard group of {len(shard)} ranks {shard} and a replicate group of "
            f"{len(replicas)} ranks {replicas} do not make a grid of the world's {world} ranks "
            "(shard size x replicas must be the world size)"
        )
    common = sorted(set(shard) & set(replicas))
    if common != [me]:
        raise ZeroParamError(
            f"{where}: the shard group {shard} and the replicate group {replicas} must meet "
            f"in this rank only, not in {common}"
        )
    if len(replicas) == 1:
        return None
    # every replica must hold the same chunk: the same index in a shard group of the same size
    backend = str(dist.get_backend(replicate_group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else None
    mine = torch.tensor([dist.get_rank(group), len(shard)], dtype=torch.int64, device=device)
    rows = torch.empty(len(replicas) * 2, dtype=torch.int64, device=device)
    zcomm.all_gather_into_tensor(rows, mine, group=replicate_group)
    found = [tuple(pair) for pair in rows.view(-1, 2).tolist()]
    if len(set(found)) > 1:
        held = ", ".join(
            f"rank {r}: index {i} of {s}" for r, (i, s) in zip(replicas, found, strict=True)
        )
        raise ZeroParamError(
            f"{where}: its ranks must have the same index in shard groups of the same size "
            f"(each replica holds the same chunks); they have {held}"
        )
    return replicate_group
