"""Process groups: `new_group`, and groups built from rank lists, once, and cached.

torch requires every rank to call ``new_group`` for every group, in the same order, even for
groups it is not in. `groups_for` builds all the groups of a partition of the ranks (one per
list) in list order and caches them by the lists, so a second topology or grid with the same
layout reuses them instead of making new communicators. `destroy` empties the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from zcomm._world import get_rank, get_world_size, on_destroy

if TYPE_CHECKING:
    from zcomm._topology import ProcessTopology

__all__ = ["get_axis_group", "groups_for", "new_group"]

# (ranks of each group, in creation order) -> the groups; lives until `destroy`.
_partition_cache: dict[tuple[tuple[int, ...], ...], list[dist.ProcessGroup]] = {}
on_destroy(_partition_cache.clear)


def _check_ranks(where: str, ranks: Any) -> list[int]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"{where}: expected a list of ranks, got {type(ranks).__name__}")
    world = get_world_size()
    checked = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
            raise ValueError(f"{where}: {r!r} is not a rank of a world of {world}")
        checked.append(r)
    if len(set(checked)) != len(checked):
        raise ValueError(f"{where}: ranks repeat: {checked}")
    return checked


def new_group(
    ranks: Sequence[int] | None = None,
    *,
    timeout: timedelta | None = None,
    backend: str | None = None,
) -> dist.ProcessGroup:
    """A new process group of global `ranks` (all ranks by default).

    Every rank of the world must call it, with the same ranks, in the same order. A rank
    outside `ranks` gets a group handle it must not use in collectives.
    """
    checked = None if ranks is None else _check_ranks("new_group(ranks=...)", ranks)
    if checked is not None and not checked:
        raise ValueError("new_group(ranks=...): the list is empty")
    # Non-members get torch's NON_GROUP_MEMBER placeholder, typed here as a group.
    return cast(dist.ProcessGroup, dist.new_group(checked, timeout=timeout, backend=backend))


def groups_for(lists: Sequence[Sequence[int]]) -> list[dist.ProcessGroup]:
    """One group per rank list, built by every rank in list order, cached by the lists."""
    key = tuple(tuple(ranks) for ranks in lists)
    cached = _partition_cache.get(key)
    if cached is None:
        cached = [new_group(list(ranks)) for ranks in key]
        _partition_cache[key] = cached
    return cached


def get_axis_group(topology: ProcessTopology, axis: str) -> dist.ProcessGroup:
    """The group of ranks that share every coordinate of `topology` but the one on `axis`.

    For ``axis="data"`` that is this rank's data-parallel group, for ``"pipe"`` its pipeline.
    All of the axis's groups are built on the first call (by every rank) and cached.
    """
    lists = topology.get_axis_comm_lists(axis)
    if not lists:
        raise ValueError(
            f"get_axis_group(axis={axis!r}): not an axis of {topology.get_axis_names()}"
        )
    if topology.world_size() != get_world_size():
        raise ValueError(
            f"get_axis_group: the topology has {topology.world_size()} ranks "
            f"but the world has {get_world_size()}"
        )
    me = get_rank()
    for ranks, group in zip(lists, groups_for(lists), strict=True):
        if me in ranks:
            return group
    raise AssertionError(f"rank {me} is in no list of axis {axis!r}")  # lists cover every rank
