"""Where each rank's fp32 master weights and gradients live: one flat buffer of each.

[Note: flat partitions]
Every optimizer parameter group becomes one flat fp32 tensor, this rank's *partition*: for
ZeRO-3 the concatenation of its parameters' shards (``ds_tensor``, ceil(n / W) elements each);
for stages 1 and 2 the r-th of W equal slices of the group's parameters laid end to end (a
parameter may straddle two ranks); for stage 0 the whole group. All groups' partitions lie in
one buffer (``fp32_partitions_flat``), and their gradients in another of the same layout
(``grad_partitions_flat_buffer``, DeepSpeed's name). The torch optimizer steps one tensor per
group, whatever the number of parameters, and a parameter's piece of either buffer is a view
(`Fragment`), which is what the ``safe_get_*`` functions hand out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

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
    """The fp32 master partitions and their gradients, for every parameter group."""

    def __init__(
        self,
        groups: Sequence[Sequence[tuple[nn.Parameter, int, int]]],
        device: torch.device,
        sizes: Sequence[int],
        grad_dtype: torch.dtype = torch.float32,
    ) -> None:
        """`groups`: per group, (parameter, param_offset, numel) of each piece this rank holds,
        in order; `sizes`: each group's partition size (pieces plus padding); `grad_dtype`:
        the gradient buffer's (the compute dtype keeps model states at (2+2+12) bytes per
        parameter over the ranks; fp32 accumulates more precisely)."""
        total = sum(sizes)
        self.fp32_partitions_flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.grad_partitions_flat_buffer = torch.zeros(total, dtype=grad_dtype, device=device)
        self.masters: list[torch.Tensor] = []  # per group, a view of fp32_partitions_flat
        self.grads: list[torch.Tensor] = []  # per group, a view of the gradient buffer
        self.fragments: dict[int, Fragment] = {}  # id(param) -> its piece
        start = 0
        for g, (pieces, size) in enumerate(zip(groups, sizes, strict=True)):
            self.masters.append(self.fp32_partitions_flat[start : start + size])
            self.grads.append(self.grad_partitions_flat_buffer[start : start + size])
            offset = start
            for param, param_offset, numel in pieces:
                self.fragments[id(param)] = Fragment(g, offset, numel, param_offset)
                offset += numel
            start += size

    def fragments_start(self, group: int) -> int:
        """Where group `group`'s partition starts in the flat buffers."""
        return int(self.masters[group].storage_offset()) - int(
            self.fp32_partitions_flat.storage_offset()
        )

    def master_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """The fp32 master of this rank's piece of `param` (None if it has none here)."""
        frag = self.fragments.get(id(param))
        if frag is None:
            return None
        return self.fp32_partitions_flat[frag.start : frag.start + frag.numel]

    def grad_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """The fp32 gradient of this rank's piece of `param`."""
        frag = self.fragments.get(id(param))
        if frag is None:
            return None
        return self.grad_partitions_flat_buffer[frag.start : frag.start + frag.numel]
