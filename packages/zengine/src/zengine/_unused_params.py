"""``zero_optimization.ignore_unused_parameters: false``: a step whose accumulation left a
trainable parameter without a gradient on some rank is refused, naming the parameters.

DeepSpeed asserts this at stages 1 and 2 with CPU offload only (while computing the gradient
norm); here it holds at every stage. Each trainable parameter gets a post-accumulate-grad hook
(only when the check is asked for: the default, true, costs nothing) that marks it as having
had a gradient since the last step. At the boundary's `step()` the ranks agree, in one small
all-reduce, whether any of them misses one, so that every rank raises, and none is left
waiting in the step's collectives for a rank that stopped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import zcomm
from zengine._errors import UsageError

__all__ = ["UnusedParameterCheck", "is_optimized"]

_NAMED = 5  # parameters named in the message; the rest are counted


def is_optimized(p: torch.Tensor) -> bool:
    """Whether the optimizer steps `p`: trainable and with elements (DeepSpeed's
    ``is_optimized_parameter``; a ZeRO-3 parameter's elements are its ``ds_numel``)."""
    return p.requires_grad and int(getattr(p, "ds_numel", p.numel())) > 0


class UnusedParameterCheck:
    """Marks the trainable parameters of `module` that had a gradient since the last step."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None) -> None:
        self.group = group
        trainable = [(name, p) for name, p in module.named_parameters() if is_optimized(p)]
        self._names = {id(p): name for name, p in trainable}
        self._seen: set[int] = set()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._arrived)  # type: ignore[no-untyped-call]
            for _, p in trainable
        ]

    def _arrived(self, param: torch.Tensor) -> None:
        self._seen.add(id(param))

    def check(self) -> None:
        """Raise `UsageError` on every rank if any rank had a trainable parameter without a
        gradient since the last step (a collective)."""
        missing = [name for key, name in self._names.items() if key not in self._seen]
        flag = torch.tensor([float(bool(missing))])
        if zcomm.get_world_size(self.group) > 1:
            zcomm.all_reduce(flag, op=zcomm.ReduceOp.MAX, group=self.group)
        if not flag.item():
            return
        rank = zcomm.get_rank(self.group)
        if missing:
            shown = ", ".join(repr(name) for name in missing[:_NAMED])
            more = f" and {len(missing) - _NAMED} more" if len(missing) > _NAMED else ""
            found = f"on rank {rank}, {len(missing)} trainable parameters had none: {shown}{more}"
        else:
            found = f"rank {rank} had every gradient, another rank did not (see its error)"
        raise UsageError(
            "engine.step(): zero_optimization.ignore_unused_parameters is false and a trainable "
            f"parameter got no gradient since the last step ({found}). The module has "
            "parameters that were not used in producing the loss: set "
            "ignore_unused_parameters to true, or make every trainable parameter take part in "
            "the loss (or freeze it with requires_grad=False)"
        )

    def reset(self) -> None:
        """A step was taken: the next accumulation starts with no gradient seen."""
        self._seen.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
