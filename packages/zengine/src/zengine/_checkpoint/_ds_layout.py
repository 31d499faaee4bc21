"""Where each parameter's elements lie in DeepSpeed's flat buffers: pure arithmetic over what
its checkpoint records (parameter shapes, partition sizes, world size).

[Note: reading DeepSpeed's layouts]
DeepSpeed stores each rank's partition of flat buffers, not parameters. Every layout here comes
down to *extents*: a run of a parameter's flattened elements ``[param_offset, param_offset +
length)`` that lies at ``offset`` in one rank's flat buffer (the same place for the master and
for each optimizer state, which DeepSpeed lays out alike):

- stages 1-2: a parameter group's parameters are concatenated (each followed by its alignment
  padding, ``param_alignment_paddings``) into one flat buffer split into equal partitions, rank
  r's ``[r*P, (r+1)*P)``; a parameter can straddle ranks;
- stage 3: every parameter is split alone, rank r holding ``[r*c, (r+1)*c)`` with c =
  ceil(numel / W); a rank's buffer is its piece of every parameter in order (the sub-groups of
  ``sub_group_size`` concatenated);
- stage 0: one rank's file holds everything; with fp16/bf16 each group's masters are one flat
  buffer (its parameters in the optimizer's order), in fp32 the optimizer state is per
  parameter and the masters are the module's weights;
- universal (``ds_to_universal``): a file per parameter and state, whole.

A rank loading at another world size reads the extents overlapping its own pieces; the files
are mapped (``mmap``), so a rank pages in only what it reads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from zengine._checkpoint._errors import CorruptCheckpointError

__all__ = [
    "Extent",
    "Param",
    "groups_of_spaces",
    "layout_stage0",
    "layout_stage3",
    "layout_stage12",
    "layout_universal",
    "shape_of",
]


@dataclasses.dataclass(frozen=True)
class Extent:
    rank: int  # the data-parallel rank whose file holds it
    offset: int  # where in that rank's flat buffer
    param_offset: int  # where in the flattened parameter
    length: int


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    group: int  # the optimizer parameter group
    space: int  # which flat buffer of a rank (a group at stages 0-2; 0 at stage 3)
    extents: tuple[Extent, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Shapes = Sequence[Mapping[str, Any]]  # ``param_shapes``: per flat buffer, name -> size


def shape_of(size: Any) -> tuple[int, ...]:
    """A ``torch.Size`` (or any sequence) as a tuple of ints."""
    return tuple(int(s) for s in size)


def groups_of_spaces(param_groups: Sequence[Mapping[str, Any]], count: int) -> list[int]:
    """The parameter group of each of `count` flat buffers: stage 3's sub-groups are listed
    under their group's ``params``; at stages 0-2 a buffer is a group."""
    owner = list(range(count))
    for g, group in enumerate(param_groups):
        for space in group.get("params", []):
            if isinstance(space, int) and space < count:
                owner[space] = g
    return owner


def layout_stage12(
    shapes: Shapes, paddings: Sequence[Sequence[int] | None], partitions: Sequence[int]
) -> dict[str, Param]:
    """Stages 1-2: group g's parameters concatenated, each followed by its alignment padding,
    cut into partitions of `partitions[g]` elements (rank 0's; the last rank's padding is not
    saved)."""
    params = {}
    for g, group in enumerate(shapes):
        partition, start = partitions[g], 0
        for i, (name, size) in enumerate(group.items()):
            shape = shape_of(size)
            numel = math.prod(shape)
            extents, done = [], 0
            while done < numel:
                rank, offset = divmod(start + done, partition)
                length = min(numel - done, partition - offset)
                extents.append(Extent(rank, offset, done, length))
                done += length
            params[name] = Param(name, shape, g, g, tuple(extents))
            padding = paddings[g]
            start += numel + (padding[i] if padding else 0)
    return params


def layout_stage3(shapes: Shapes, owner: Sequence[int], world: int) -> dict[str, Param]:
    """Stage 3: each parameter split alone into `world` chunks, a rank's buffer its chunk of
    every parameter in order (sub-groups concatenated); `owner`: each sub-group's group."""
    params, offset = {}, 0
    for sub_group, group in enumerate(shapes):
        for name, size in group.items():
            shape = shape_of(size)
            numel = math.prod(shape)
            chunk = math.ceil(numel / world)
            extents = tuple(
                Extent(r, offset, r * chunk, min(chunk, numel - r * chunk))
                for r in range(world)
                if numel - r * chunk > 0
            )
            params[name] = Param(name, shape, owner[sub_group], 0, extents)
            offset += chunk
    return params


def layout_stage0(
    group_names: Sequence[Sequence[str]], module: Mapping[str, Any], where: str
) -> dict[str, Param]:
    """Stage 0: group g's masters one flat buffer of its parameters (`group_names`, which a
    stage-0 save does not record) in order; their shapes from the `module` state."""
    params = {}
    for g, names in enumerate(group_names):
        offset = 0
        for name in names:
            if name not in module:
                raise CorruptCheckpointError(
                    f"{where}: no parameter {name!r} in the module's state"
                )
            shape = shape_of(module[name].shape)
            numel = math.prod(shape)
            params[name] = Param(name, shape, g, g, (Extent(0, offset, 0, numel),))
            offset += numel
    return params


def layout_universal(shapes: Shapes, owner: Sequence[int] | None) -> dict[str, Param]:
    """A universal folder: every parameter whole in files of its own; `owner` as at stage 3
    (None: a buffer is a group)."""
    params = {}
    for space, group in enumerate(shapes):
        g = owner[space] if owner is not None else space
        for name, size in group.items():
            shape = shape_of(size)
            params[name] = Param(name, shape, g, space, (Extent(0, 0, 0, math.prod(shape)),))
    return params
