"""The secondary partition: ZeRO++'s hpZ, a node-local copy of each unit from forward to backward.

[Note: secondary partition]
DeepSpeed's ``zero_hpz_partition_size`` (ZeRO++'s hpZ), FSDP2's ``reshard_after_forward=<int>``.
A training step gathers each released unit twice, for its forward and again for its backward;
with the ranks partitioned across (W of them) spanning nodes, both gathers cross the slow links.
With a secondary partition of S ranks (``ZeroParamConfig.secondary_partition_size``; S divides a
node's ranks and W), each rank keeps a *secondary shard* of a unit when it gathers it for a
forward: k = W / S of the gathered rows ([Note: unit layout]: rank-major, one row per rank's
shard), rows s*k to s*k + k - 1, where s is its place in its *secondary group*, the S
consecutive ranks of the group partitioned across that it lies in, all on one node. A secondary
group's S secondary shards hold every row once, in order, so their all-gather within the group
is the (S, k, row) = (W, row) rows the world's gather gives, and the copy-out into the full
buffer is the same one (`Unit.wait`). The backward's gathers then stay inside the node; the
forward's gathers and the gradients' reduce-scatters still cross nodes. Memory: 1/S of each
released unit's gathered bytes per rank, held from its forward's gather to its backward's.

When (`Unit`, `Coordinator`):
- kept: by a pass's gather from the primary shards outside a backward with grad enabled (a
  training forward, its prefetches included), a copy of the rows as gathered: narrow wire bytes
  where the forward gathered ``comm_dtype``'s narrower dtype, so that the backward widens the
  very values the forward computed with. Persistent units never release: they keep none. Under
  ``no_grad`` nothing is kept (no backward follows).
- used: by every pass's gather of a unit holding one, the backward's and a second use in the
  same forward alike; `GatheredParameters` and the other exact readers gather the primaries.
- dropped: at the unit's fetch in a backward (after its gather, or at once when the unit was
  kept gathered since its forward), at the end of a backward (a unit whose backward fetched
  nothing), by `Partitioned.release_all` and `remove`; and taken as gone once the shards'
  version moved since it was kept (an optimizer step, a ``ds_tensor`` write: the next gather
  reads the primaries, which hold the new values). A forward with grad that no backward follows
  leaves its secondaries until the next one is kept or a backward ends.
- agreed: a batch's gathers from primaries are announced on the model's channel, those from
  secondaries on the secondary group's ([Note: agreement]), so no header of the backward's
  gathers crosses nodes. Which units go which way is state every rank holds alike: the gathers
  it kept them at were agreed, and the shards' versions move alike on every rank, since every
  rank runs the same optimizer (as `Unit.refresh` decides for persistent units).

The groups: consecutive blocks of S ranks across the world when partitioning across the world;
otherwise (hybrid sharding's shard group, [Note: hybrid sharding]: the two compose, the secondary
groups lying within the shard groups) every rank's block is exchanged in one all-gather across
the world, checked (the same blocks everywhere, each on one node) and built by every rank. So
with S > 1 every rank of the world partitions at once, as torch's ``new_group`` requires. With
shard groups within a node, hybrid sharding's gathers never leave it anyway: hpZ then costs its
memory and buys nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import zcomm
from zcomm.topology import ProcessTopology
from zpartition._channel import Channel
from zpartition._errors import ZeroParamError

__all__ = ["check_secondary_size", "secondary_channel"]


def check_secondary_size(size: int, ranks: int) -> None:
    """Raise `ZeroParamError` unless a secondary partition of `size` ranks fits this world's
    nodes (`zcomm.node_layout`) and a group of `ranks` ranks partitioned across: it must divide
    both, a node's ranks first (larger than a node, its gathers would cross nodes)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ZeroParamError(f"secondary_partition_size {size!r}: expected a number of ranks >= 1")
    if size == 1:
        return
    node = zcomm.node_layout().ranks_per_node
    if node % size:
        larger = " is larger than a node and" if size > node else ""
        raise ZeroParamError(
            f"secondary_partition_size {size}{larger} does not divide a node's {node} ranks: "
            "its secondary groups, where the backward gathers, must each lie within a node"
        )
    if ranks % size:
        raise ZeroParamError(
            f"secondary_partition_size {size} does not divide the {ranks} ranks partitioned "
            "across: each secondary group holds a unit's gathered rows once"
        )


def secondary_channel(channel: Channel, size: int) -> Channel | None:
    """The channel of this rank's secondary group of `size` ranks within `channel`'s group
    (None with `size` 1: no secondary partition). Collective across the world; raises
    `ZeroParamError` for a size or groups that do not fit (see [Note: secondary partition])."""
    check_secondary_size(size, channel.size)
    if size == 1:
        return None
    layout = zcomm.node_layout()
    world = dist.get_world_size()
    blocks = [list(range(first, first + size)) for first in range(0, world, size)]
    group = channel.group
    if group is not None:
        ranks = list(dist.get_process_group_ranks(group))
        start = channel.rank // size * size
        blocks = _exchange(ranks[start : start + size])
    for block in blocks:
        if layout.spans_nodes(block):
            raise ZeroParamError(
                f"secondary_partition_size {size}: the secondary group of ranks {block} "
                f"(consecutive ranks of a group partitioned across) spans nodes of "
                f"{layout.ranks_per_node} ranks; its gathers would cross nodes"
            )
    me = dist.get_rank()
    consecutive = [list(range(first, first + size)) for first in range(0, world, size)]
    if blocks == consecutive:  # built, and cached by zcomm, as a grid's axis
        grid = ProcessTopology(axes=["block", "secondary"], dims=[world // size, size])
        mine = zcomm.get_axis_group(grid, "secondary")
    else:  # every rank builds every group, in the same order
        built = [zcomm.new_group(block) for block in blocks]
        mine = next(g for g, block in zip(built, blocks, strict=True) if me in block)
    secondary = Channel(mine)
    secondary.units = channel.units  # its headers name the model's units
    return secondary


def _exchange(block: list[int]) -> list[list[int]]:
    """Every rank's secondary block (global ranks), gathered across the world, checked to be
    the same on each of its ranks; the distinct blocks by their first rank."""
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else None
    world = dist.get_world_size()
    mine = torch.tensor(block, dtype=torch.int64, device=device)
    rows = torch.empty(world * len(block), dtype=torch.int64, device=device)
    zcomm.all_gather_into_tensor(rows, mine)
    said = [list(map(int, row)) for row in rows.view(world, -1).tolist()]
    for rank, ranks in enumerate(said):
        other = next((q for q in ranks if said[q] != ranks), None)
        if rank not in ranks or other is not None:
            raise ZeroParamError(
                f"secondary groups disagree: rank {rank}'s is {ranks}"
                + (f", rank {other}'s {said[other]}" if other is not None else "")
                + " (the groups partitioned across must cut the world alike on every rank)"
            )
    return sorted({tuple(ranks): ranks for ranks in said}.values())
