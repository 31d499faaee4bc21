"""``deepspeed.runtime.utils``: `move_to_device`, `see_memory_usage` and `noop_decorator`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_map

from zengine.utils import see_memory_usage

__all__ = ["move_to_device", "noop_decorator", "see_memory_usage"]

_T = TypeVar("_T")


def noop_decorator(func: _T) -> _T:
    """`func` itself: DeepSpeed's stand-in where a decorator is not available."""
    return func


def move_to_device(
    item: _T, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None
) -> _T:
    """`item` with every tensor nested in its lists, tuples and dicts moved to `device` (those
    `criterion_func` accepts, when given), as DeepSpeed's."""
    accept = criterion_func or torch.is_tensor

    def move(value: Any) -> Any:
        return value.to(device) if torch.is_tensor(value) and accept(value) else value

    moved: _T = tree_map(move, item)
    return moved
