"""``deepspeed.runtime.zero.partition_parameters``: `Init`, `GatheredParameters`, the status
enum, and the two names Transformers swaps around ``zero.Init`` to keep RoPE buffers' dtype.

zpartition's `Init` does not wrap tensor constructors (it casts parameters after a module is
built, never buffers), so `zero_wrapper_for_fp_tensor_constructor` is only the hook point
Transformers replaces and restores: nothing in zstack calls it, and buffers keep their dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed._refused import refused
from zcomm import get_accelerator
from zpartition import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "ZeroParamStatus",
    "_orig_torch_arange",
    "get_accelerator",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
) -> Callable[..., torch.Tensor]:
    """`fn` unchanged: zpartition's `Init` leaves tensor constructors alone."""
    del args, kwargs
    return fn


MiCS_Init = refused(
    "deepspeed.zero.MiCS_Init",
    "hybrid sharding (MiCS)",
    "Use deepspeed.zero.Init, which shards over every rank.",
)
