"""Where each rank's fp32 master weights and gradients live.

[Note: flat partitions]
Every optimizer parameter group has one flat fp32 gradient partition on each rank: for ZeRO-3
the concatenation of its parameters' shards (``ds_tensor``, ceil(n / W) elements each); for
stages 1 and 2 the r-th of W equal slices of the group's parameters laid end to end (a
parameter may straddle two ranks); for stage 0 the whole group. All groups' gradients lie in
one buffer (``grad_partitions_flat_buffer``, DeepSpeed's name). The masters follow the same
layout in one buffer (``fp32_partitions_flat``) at stages 0-2, where the torch optimizer steps
one tensor per group; at stage 3 the fp32 shards are their own masters, and other masters lie
in one flat buffer per tile of the step and group, so that a step can go a few parameters at a
time ([Note: tiled steps]). A parameter's piece of either is a view (`Fragment`), which is what
the ``safe_get_*`` functions hand out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from zoffload import release_pages

__all__ = ["Fragment", "Partitions"]


@dataclasses.dataclass(frozen=True)
class Fragment:
    """This rank's piece of one parameter: where it lies in the flat buffers and in the
    parameter's flattened data."""

    group: int  # index of the optimizer parameter group
    start: int  # offset in the flat buffers
    numel: int  # elements on this rank (0 if the parameter lies wholly on other ranks)
    param_offset: int  # offset of the piece in the parameter's flattened (full) data


class Partitions:
    """The fp32 master partitions and their gradients, for every parameter group.

    The masters are a new fp32 buffer, unless the parameters are fp32 already: then they are
    the parameters' own storage, which no second copy is needed of. `FlatLayout` hands in its
    groups' fp32 partitions (`masters`), one flat tensor each; `ShardedLayout` hands in each
    parameter's master with the tensor the optimizer steps for it (`shards`: the shard itself
    when fp32, else a view of its tile's flat master).
    """

    def __init__(
        self,
        groups: Sequence[Sequence[tuple[nn.Parameter, int, int]]],
        device: torch.device,
        sizes: Sequence[int],
        grad_dtype: torch.dtype = torch.float32,
        *,
        masters: Sequence[torch.Tensor] | None = None,
        shards: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """`groups`: per group, (parameter, param_offset, numel) of each piece this rank holds,
        in order; `sizes`: each group's partition size (pieces plus padding); `grad_dtype`:
        the gradient buffer's (the compute dtype keeps model states at (2+2+12) bytes per
        parameter over the ranks; fp32 accumulates more precisely)."""
        total = sum(sizes)
        owned = masters is None and shards is None
        self.fp32_partitions_flat: torch.Tensor | None = (
            torch.zeros(total, dtype=torch.float32, device=device) if owned else None
        )  # the masters, when they are a copy of their own
        # zeroed by handing its pages back: the pages a backward writes become resident, not
        # the whole buffer at once (a tiled NVMe step keeps a few tiles: [Note: gradients
        # beyond memory])
        self.grad_partitions_flat_buffer = torch.empty(total, dtype=grad_dtype, device=device)
        release_pages(self.grad_partitions_flat_buffer)  # a device's is zeroed
        # stage 3: id(param) -> its master, and the tensor the optimizer steps that holds it
        self.shards = None if shards is None else {k: m for k, (m, _) in shards.items()}
        self._stepped_of = None if shards is None else {k: t for k, (_, t) in shards.items()}
        self.masters: list[torch.Tensor] = []  # per group, one flat fp32 tensor (not with shards)
        self.grads: list[torch.Tensor] = []  # per group, a view of the gradient buffer
        self.starts: list[int] = []  # per group, its offset in the gradient buffer
        self.fragments: dict[int, Fragment] = {}  # id(param) -> its piece
        start = 0
        for g, (pieces, size) in enumerate(zip(groups, sizes, strict=True)):
            if self.fp32_partitions_flat is not None:
                self.masters.append(self.fp32_partitions_flat[start : start + size])
            elif masters is not None:
                self.masters.append(masters[g])
            self.grads.append(self.grad_partitions_flat_buffer[start : start + size])
            self.starts.append(start)
            offset = start
            for param, param_offset, numel in pieces:
                self.fragments[id(param)] = Fragment(g, offset, numel, param_offset)
                offset += numel
            start += size

    def stepped(
        self, group: int, params: Sequence[nn.Parameter]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What the torch optimizer steps for `group`, with its gradients: the group's flat
        master, or (stage 3) each shard, or each tile's flat of masters, whose parameters'
        gradients lie side by side in the same order."""
        if self._stepped_of is None:
            return [(self.masters[group], self.grads[group])]
        found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for p in params:
            tensor = self._stepped_of[id(p)]
            if id(tensor) not in found:
                start = self.fragments[id(p)].start - self.offset_in(p)
                grad = self.grad_partitions_flat_buffer[start : start + tensor.numel()]
                found[id(tensor)] = (tensor, grad.view_as(tensor))
        return list(found.values())

    def offset_in(self, param: torch.Tensor) -> int:
        """Where `param`'s master starts in the tensor the optimizer steps for it."""
        if self.shards is None or self._stepped_of is None:
            frag = self.fragments[id(param)]
            return frag.start - self.starts[frag.group]
        master, tensor = self.shards[id(param)], self._stepped_of[id(param)]
        return int(master.storage_offset() - tensor.storage_offset())

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master of this rank's piece of `param` (None if it has none here)."""
        frag = self.fragments.get(id(param))
        if frag is None:
            return None
        if self.shards is not None:
            return self.shards[id(param)]
        offset = frag.start - self.starts[frag.group]
        return self.masters[frag.group][offset : offset + frag.numel]

    def state_key(self, param: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """The tensor the optimizer keeps `param`'s state under, and the piece's offset in it."""
        frag = self.fragments.get(id(param))
        if frag is None:
            return None
        stepped = (
            self.masters[frag.group] if self._stepped_of is None else self._stepped_of[id(param)]
        )
        return stepped, self.offset_in(param)

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The fp32 gradient of this rank's piece of `param`."""
        frag = self.fragments.get(id(param))
        if frag is None:
            return None
        return self.grad_partitions_flat_buffer[frag.start : frag.start + frag.numel]
