"""``deepspeed.checkpoint.utils``: `clone_tensors_for_torch_save`."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch.utils._pytree import tree_map

__all__ = ["clone_tensors_for_torch_save"]

_T = TypeVar("_T")


def clone_tensors_for_torch_save(item: _T, device: torch.device | str = "cpu") -> _T:
    """`item` with every nested tensor cloned onto `device`, so ``torch.save`` writes each
    tensor's own elements rather than the whole storage a view shares (DeepSpeed's)."""

    def clone(value: object) -> object:
        return value.detach().clone().to(device) if isinstance(value, torch.Tensor) else value

    cloned: _T = tree_map(clone, item)
    return cloned
