"""Nodes: which ranks share a machine, the groups within and across nodes, and whether an
operation's traffic crosses nodes.

Nodes are contiguous blocks of global ranks, all of one size, as torchrun numbers them: node
n holds ranks ``n * k`` to ``n * k + k - 1``. A world's layout is, in this order: the one
`set_node_layout` gave (every rank calls it alike; tests pretend 4 processes are 2 nodes of
2), the launcher's (torchrun's LOCAL_WORLD_SIZE, GROUP_RANK, LOCAL_RANK), checked across the
ranks, or one node holding the whole world when no launcher said anything. It is worked out
once per world and forgotten by `destroy`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from zcomm._accelerator import get_accelerator
from zcomm._errors import comm_error
from zcomm._groups import groups_for
from zcomm._world import _env_int, get_rank, group_size, on_destroy

__all__ = [
    "NodeLayout",
    "TopologyError",
    "crosses_nodes",
    "inter_node_group",
    "intra_node_group",
    "layout_from_launcher",
    "node_layout",
    "set_node_layout",
]

# torch 2.13 renamed the tensor collectives (the old names warn); as in _collectives, which
# this module cannot import (_collectives -> _handle -> here).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class TopologyError(ValueError):
    """The world's nodes are not a layout zcomm can use: nodes of unequal size, a node whose
    ranks are not one contiguous block, launcher variables that disagree, or a node size that
    does not divide the world."""


@dataclass(frozen=True)
class NodeLayout:
    """`nodes` nodes of `ranks_per_node` ranks each; node n holds the global ranks
    ``n * ranks_per_node`` to ``(n + 1) * ranks_per_node - 1``."""

    ranks_per_node: int
    nodes: int

    def __post_init__(self) -> None:
        for name in ("ranks_per_node", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NodeLayout({name}=...): expected a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        """The number of ranks of all nodes together."""
        return self.ranks_per_node * self.nodes

    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{rank!r} is not a rank of {self} ({self.world_size} ranks)")
        return rank

    def node_of(self, rank: int) -> int:
        """The node that holds global rank `rank`."""
        return self._rank(rank) // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        """The place of global rank `rank` on its node (torchrun's LOCAL_RANK)."""
        return self._rank(rank) % self.ranks_per_node

    def ranks_of(self, node: int) -> list[int]:
        """The global ranks of `node`, in order."""
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ValueError(f"{node!r} is not a node of {self}")
        first = node * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        """Whether `ranks` (a group's global ranks) lie on more than one node."""
        return len({self.node_of(rank) for rank in ranks}) > 1


# This world's layout once worked out or set; None until then, and again after `destroy`.
_layout: NodeLayout | None = None
# What the accounting uses before `_layout` is known (see `crosses_nodes`).
_unchecked: NodeLayout | None = None
# Whether a group's ranks span nodes, by group (None: the world), for the layout in use;
# emptied whenever that layout changes.
_spans: dict[dist.ProcessGroup | None, bool] = {}


def _use(layout: NodeLayout | None) -> None:
    global _layout, _unchecked
    _layout, _unchecked = layout, None
    _spans.clear()


on_destroy(lambda: _use(None))


def set_node_layout(ranks_per_node: int) -> NodeLayout:
    """Declare this world as nodes of `ranks_per_node` ranks (contiguous blocks) and return
    the layout; it replaces the launcher's until `destroy`.

    Every rank calls it, with the same number. Tests use it to pretend one machine is several
    nodes (4 processes as 2 nodes of 2). A number that does not divide the world size raises
    `TopologyError`.
    """
    world = group_size("set_node_layout", None)
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
        raise TypeError(
            f"set_node_layout(ranks_per_node=...): expected an int, got {ranks_per_node!r}"
        )
    if ranks_per_node < 1 or world % ranks_per_node:
        raise TopologyError(
            f"set_node_layout(ranks_per_node={ranks_per_node}): a world of {world} ranks "
            f"cannot be split into nodes of {ranks_per_node}"
        )
    layout = NodeLayout(ranks_per_node, world // ranks_per_node)
    _use(layout)
    return layout


def node_layout() -> NodeLayout:
    """This world's nodes: `set_node_layout`'s, else the launcher's, else one node.

    The first call in a world of several ranks without `set_node_layout` is collective (one
    all-gather of every rank's launcher variables, checked alike on every rank): every rank
    makes it, as they make `new_group` calls. Later calls answer from a cache until `destroy`.
    Raises `TopologyError` when the launcher's nodes are unequal or not contiguous.
    """
    layout = _layout
    if layout is None:
        layout = _from_launcher()
        _use(layout)
    return layout


def _launcher_variables() -> tuple[int, int, int]:
    """This rank's (GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE); -1 for a variable not set."""
    names = ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    group, local, size = (_env_int(name) if name in os.environ else -1 for name in names)
    return group, local, size


def _from_launcher() -> NodeLayout:
    world = group_size("node_layout", None)
    if world == 1:
        return NodeLayout(1, 1)
    # Every rank gathers, whatever its own environment says, so that the ranks agree on
    # whether to communicate (a rank without the variables would otherwise wait alone), and
    # every rank then draws the same conclusion, or raises the same error, from the same data.
    device = (
        torch.device(get_accelerator().current_device_name())
        if dist.get_backend() == "nccl"  # NCCL carries device tensors only
        else torch.device("cpu")
    )
    mine = torch.tensor(_launcher_variables(), dtype=torch.int64, device=device)
    every = torch.empty(world * 3, dtype=torch.int64, device=device)
    try:
        # torch.distributed's own call, not zcomm's: the accounting must not count it, and
        # counting it would ask for the layout being worked out here
        _all_gather_single(every, mine)
    except RuntimeError as error:
        raise comm_error("node_layout", None, error) from error
    reports = [cast(tuple[int, int, int], tuple(row)) for row in every.view(world, 3).tolist()]
    return layout_from_launcher(reports)


def _span(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {list(ranks)}"


def _describe(nodes: list[tuple[str, list[int]]], limit: int = 8) -> str:
    said = [f"{name} has {_span(ranks)} ({len(ranks)})" for name, ranks in nodes[:limit]]
    if len(nodes) > limit:
        said.append(f"and {len(nodes) - limit} more nodes")
    return ", ".join(said)


def layout_from_launcher(reports: Sequence[tuple[int, int, int]]) -> NodeLayout:
    """The layout that the launcher variables of every rank describe, or `TopologyError`.

    ``reports[r]`` is rank r's (GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE), -1 where unset.
    With LOCAL_WORLD_SIZE set nowhere the world is one node. A rank's node is its GROUP_RANK
    (torchrun's node number), else the block that its LOCAL_RANK counts from.
    """
    world = len(reports)
    if world < 1:
        raise ValueError("layout_from_launcher: no ranks")
    sized = [rank for rank, (_, _, size) in enumerate(reports) if size >= 0]
    if not sized:
        return NodeLayout(world, 1)
    if len(sized) < world:
        unsized = sorted(set(range(world)) - set(sized))
        raise TopologyError(
            f"LOCAL_WORLD_SIZE is set on {_span(sized)} but not on {_span(unsized)}: "
            "start every rank with the same launcher"
        )
    members: dict[tuple[str, int], list[int]] = {}  # in the order of their first rank
    for rank, (group, local, size) in enumerate(reports):
        if group >= 0:
            key = ("GROUP_RANK", group)
        elif local >= 0:
            key = ("first rank", rank - local)
        else:
            key = ("first rank", rank - rank % max(size, 1))
        members.setdefault(key, []).append(rank)
    nodes = [
        (f"node {i}" if key[0] == "first rank" else f"node {i} (GROUP_RANK={key[1]})", ranks)
        for i, (key, ranks) in enumerate(members.items())
    ]
    for name, ranks in nodes:
        if ranks != list(range(ranks[0], ranks[-1] + 1)):
            raise TopologyError(
                f"{name} has {_span(ranks)}: a node's ranks must be one contiguous block "
                "(as torchrun numbers them)"
            )
    if len({len(ranks) for _, ranks in nodes}) > 1:
        raise TopologyError(f"nodes of unequal size: {_describe(nodes)}")
    for name, ranks in nodes:
        for place, rank in enumerate(ranks):
            _, local, size = reports[rank]
            if size != len(ranks):
                raise TopologyError(
                    f"rank {rank} has LOCAL_WORLD_SIZE={size}, but its node, {name}, "
                    f"has {_span(ranks)} ({len(ranks)})"
                )
            if local >= 0 and local != place:
                raise TopologyError(
                    f"rank {rank} has LOCAL_RANK={local}, but it is rank {place} of its "
                    f"node, {name}, which has {_span(ranks)}"
                )
    return NodeLayout(len(nodes[0][1]), len(nodes))


def _mine(lists: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group among one group per list, built by every rank in list order."""
    if len(lists) == 1:
        # the whole world: its own group, rather than a second communicator for the same
        # ranks (on NCCL, GPU memory for nothing)
        return cast(dist.ProcessGroup, dist.group.WORLD)
    me = get_rank()
    for ranks, group in zip(lists, groups_for(lists), strict=True):
        if me in ranks:
            return group
    raise AssertionError(f"rank {me} is in no list of {lists}")  # the lists cover the world


def intra_node_group() -> dist.ProcessGroup:
    """The group of this rank's node (the world when there is one node).

    The first call builds every node's group, on every rank: a collective call.
    """
    layout = node_layout()
    return _mine([layout.ranks_of(node) for node in range(layout.nodes)])


def inter_node_group() -> dist.ProcessGroup:
    """The group of the ranks with this rank's local rank, one per node, in node order (the
    world when every node has one rank).

    The first call builds every local rank's group, on every rank: a collective call.
    """
    layout = node_layout()
    k = layout.ranks_per_node
    return _mine([[node * k + local for node in range(layout.nodes)] for local in range(k)])


def _layout_in_use() -> NodeLayout:
    """The worked-out layout, else this rank's launcher variables read without the check.

    The accounting asks while recording an operation, which may happen on some ranks only:
    it must never communicate, so before `node_layout` has run it takes LOCAL_WORLD_SIZE as
    it stands (the check, when it runs, fails on broken launches only).
    """
    global _unchecked
    if _layout is not None:
        return _layout
    if _unchecked is None:
        world = dist.get_world_size()
        given = os.environ.get("LOCAL_WORLD_SIZE", "")
        size = int(given) if given.isdigit() else world  # raising here would fail a wait()
        size = size if 1 <= size <= world and world % size == 0 else world
        _unchecked = NodeLayout(size, world // size)
    return _unchecked


def crosses_nodes(group: dist.ProcessGroup | None, peer: int | None = None) -> bool:
    """Whether an operation on `group` (None: the world) runs between nodes: its ranks span
    more than one; a point-to-point one's (`peer`, a global rank) when `peer` and this rank
    are on different nodes."""
    layout = _layout_in_use()
    if peer is not None:
        return layout.node_of(peer) != layout.node_of(dist.get_rank())
    spans = _spans.get(group)
    if spans is None:
        ranks = range(layout.world_size) if group is None else dist.get_process_group_ranks(group)
        spans = _spans[group] = layout.spans_nodes(ranks)
    return spans
