"""``deepspeed.runtime.zero.partition_parameters``: `Init`, `GatheredParameters`, the status
enum and external parameters (``deepspeed.zero``'s names), and the two names Transformers swaps
around ``zero.Init`` to keep RoPE buffers' dtype.

zpartition's `Init` does not wrap tensor constructors (it casts parameters after a module is
built, never buffers), so `zero_wrapper_for_fp_tensor_constructor` is only the hook point
Transformers replaces and restores: nothing in zstack calls it, and buffers keep their dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed.zero import MiCS_Init
from zcomm import get_accelerator
from zengine.zero import *  # noqa: F403 - deepspeed.zero's names live here in DeepSpeed
from zengine.zero import __all__ as _zero_names

__all__ = [
    *_zero_names,
    "MiCS_Init",
    "MultipleAllGatherHandles",
    "_orig_torch_arange",
    "get_accelerator",
    "partitioned_param_data_shape",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_arange = torch.arange

partitioned_param_data_shape = [0]
"""The shape of a released parameter's ``data`` (zpartition empties it, as DeepSpeed does)."""


class MultipleAllGatherHandles:
    """Several gather handles waited on as one (DeepSpeed's): ``wait(**kwargs)`` passes its
    keywords (``handle_dependency``) on to each handle's ``wait``."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self, **kwargs: Any) -> None:
        for handle in self.handles:
            handle.wait(**kwargs)


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
) -> Callable[..., torch.Tensor]:
    """`fn` unchanged: zpartition's `Init` leaves tensor constructors alone."""
    del args, kwargs
    return fn
