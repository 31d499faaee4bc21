"""``deepspeed.runtime.zero.partition_parameters``: `Init`, `GatheredParameters`, the status
enum and external parameters (``deepspeed.zero``'s names), and the two names Transformers swaps
around ``zero.Init`` to keep RoPE buffers' dtype.

zpartition's `Init` does not wrap tensor constructors (it casts parameters after a module is
built, never buffers), so `zero_wrapper_for_fp_tensor_constructor` is only the hook point
Transformers replaces and restores: nothing in zstack calls it, and buffers keep their dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch

import zcomm
from deepspeed.zero import MiCS_Init
from zcomm import get_accelerator
from zengine.zero import *  # noqa: F403 - deepspeed.zero's names live here in DeepSpeed
from zengine.zero import __all__ as _zero_names

__all__ = [
    *_zero_names,
    "CUDAQuantizer",
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


class CUDAQuantizer:
    """DeepSpeed's qwZ quantizer, over `zcomm.quantize`: symmetric int8 in `groups` equal
    groups of a tensor's flattened elements, one float32 scale each, on any device (no kernel
    to build; ``quantizer_cuda_module`` is kept only as a name). Without `groups`, DeepSpeed's
    choice: about `target_group_size` elements a group, each group a multiple of 8."""

    async_flag = True
    target_group_size = 8000
    group_size_cache: ClassVar[dict[int, int]] = {}
    quantizer_cuda_module: Any = None

    def quantize(
        self, param: torch.Tensor, groups: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 codes of `param`'s shape flattened, float32 scales, one per group)."""
        n = param.numel()
        if groups is None:  # DeepSpeed's choice, remembered per size
            groups = self.group_size_cache.get(n) or self._groups(n)
            self.group_size_cache[n] = groups
        if groups < 1 or n % groups:
            raise ValueError(
                f"CUDAQuantizer.quantize: {n} elements do not split into {groups} equal groups"
            )
        q = zcomm.quantize(param, bits=8, block_size=n // groups)
        return q.data, q.scales

    def dequantize(
        self, quantized_param: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The values of `quantize`'s codes and scales, flat, in `dtype` (DeepSpeed's fp16 by
        default)."""
        n, groups = quantized_param.numel(), scale.numel()
        q = zcomm.Quantized(
            quantized_param.reshape(-1),
            scale.reshape(-1).float(),
            n,
            8,
            n // groups,
            dtype or torch.float16,
        )
        return zcomm.dequantize(q)

    def _groups(self, n: int) -> int:
        """DeepSpeed's grouping: the fewest groups of at most `target_group_size` elements
        whose size is a multiple of 8, doubled while groups stay above the target."""
        groups = math.ceil(n / self.target_group_size)
        while groups < n and n % (8 * groups):
            groups += 1
        while n % (16 * groups) == 0 and n / groups > self.target_group_size:
            groups *= 2
        if n % (8 * groups) or n <= groups:
            raise ValueError(
                f"CUDAQuantizer.quantize: {n} elements cannot be cut into groups of a multiple "
                "of 8 elements (DeepSpeed's qwZ quantizer needs that); pass groups="
            )
        return groups
