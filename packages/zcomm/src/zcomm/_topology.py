"""A Cartesian layout of ranks over named axes, with DeepSpeed's semantics.

Ranks are laid out row-major over the axes in the order given: with ``axes=["pipe", "data"]``
the last axis varies fastest, so data-parallel peers get adjacent ranks (and, on a cluster,
the fast links inside a node), while pipeline neighbours are a node apart. This module is
pure arithmetic: no process group is touched here.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
    "_prime_factors",
]


class ProcessTopology:
    """Maps the ranks of a job to coordinates on named axes and back.

    ``ProcessTopology(axes=["x", "y"], dims=[2, 3])`` lays out 6 ranks; rank 1 is
    ``ProcessCoord(x=0, y=1)``. `ProcessCoord` is a namedtuple class with the axes as fields.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes but {len(dims)} dims")
        if not axes:
            raise ValueError("ProcessTopology(axes=...): at least one axis is needed")
        if len(set(axes)) != len(axes) or not all(
            isinstance(a, str) and a.isidentifier() for a in axes
        ):
            raise ValueError(
                f"ProcessTopology(axes=...): expected distinct identifiers, got {axes}"
            )
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
            raise ValueError(f"ProcessTopology(dims=...): expected positive integers, got {dims}")
        self.axes = axes  # the axis names, slowest-varying first
        self.dims = dims  # the length of each axis
        make_tuple: Any = namedtuple  # the fields are the axes, known only at run time
        coord_type: Any = make_tuple("ProcessCoord", axes)
        self.ProcessCoord = coord_type  # DeepSpeed's name: a namedtuple class
        # Every coordinate in rank order, and the inverse map.
        self._coords = [self.ProcessCoord(*c) for c in itertools.product(*(range(d) for d in dims))]
        self.mapping: dict[Any, int] = {c: rank for rank, c in enumerate(self._coords)}

    def __str__(self) -> str:
        return str(self.mapping)

    def __repr__(self) -> str:
        return f"ProcessTopology(axes={self.axes}, dims={self.dims})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessTopology) and (self.axes, self.dims) == (
            other.axes,
            other.dims,
        )

    def __hash__(self) -> int:
        return hash((tuple(self.axes), tuple(self.dims)))

    def world_size(self) -> int:
        """The number of ranks the topology lays out."""
        return len(self._coords)

    def get_axis_names(self) -> list[str]:
        """The axis names, in layout order."""
        return self.axes

    def get_dim(self, axis: str) -> int:
        """The length of `axis`; 0 for an axis the topology does not have."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def _check_axis(self, where: str, axis: str) -> int:
        if axis not in self.axes:
            raise ValueError(f"{where}: unknown axis {axis!r}; the axes are {self.axes}")
        return self.axes.index(axis)

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate: ``get_rank(pipe=1, data=0)``."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() does not support slices. Use filter_match())")
        for axis, value in coord_kwargs.items():
            index = self._check_axis("get_rank", axis)
            if not (isinstance(value, int) and 0 <= value < self.dims[index]):
                raise ValueError(
                    f"get_rank({axis}={value!r}): out of range [0, {self.dims[index]})"
                )
        return self.mapping[self.ProcessCoord(**coord_kwargs)]

    def get_coord(self, rank: int) -> Any:
        """The coordinate (a `ProcessCoord`) of `rank`; ``get_coord(1).y`` reads one axis."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology.")
        return self._coords[rank]

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Sequence[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """A name for `rank`'s coordinate, e.g. ``"model_01"`` (checkpoint file names use it)."""
        coord = self.get_coord(rank)
        omit = frozenset(omit_axes)
        parts = [
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit
        ]
        return outer_sep.join(parts)

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on `axis` is `idx`, in rank order."""
        index = self._check_axis("get_axis_list", axis)
        return [rank for rank, c in enumerate(self._coords) if c[index] == idx]

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates match every given axis value: ``filter_match(pipe=0)``."""
        indices = {self._check_axis("filter_match", a): v for a, v in filter_kwargs.items()}
        return [r for r, c in enumerate(self._coords) if all(c[i] == v for i, v in indices.items())]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists of the groups along `axis`: ranks that differ only on `axis`.

        Lists come in rank order of their first member. An axis the topology does not have
        gives ``[]`` (not an error), so code can ask for "model" groups whatever the layout.
        """
        if axis not in self.axes:
            return []
        index = self.axes.index(axis)
        lists: dict[tuple[int, ...], list[int]] = {}
        for rank, coord in enumerate(self._coords):
            others: tuple[int, ...] = tuple(v for i, v in enumerate(coord) if i != index)
            lists.setdefault(others, []).append(rank)
        return list(lists.values())


def _prime_factors(n: int) -> list[int]:
    """The prime factors of a positive integer, smallest first, with repeats (1 gives [])."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"Values must be strictly positive, got {n!r}")
    factors, candidate = [], 2
    while n > 1:
        while n % candidate == 0:
            factors.append(candidate)
            n //= candidate
        candidate += 1 if candidate == 2 else 2
        if candidate * candidate > n > 1:
            factors.append(n)
            break
    return factors


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism, data on the fast (last) axis: ``axes=["pipe", "data"]``."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism: ``axes=["pipe", "data", "model"]``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
