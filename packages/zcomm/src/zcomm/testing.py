"""The distributed test harness: `DistributedTest` and `preferred_dtype` (DeepSpeed's names)."""

from __future__ import annotations

import torch

from zcomm._accelerator import get_accelerator
from zcomm._dist_test import DistributedTest

__all__ = ["DistributedTest", "preferred_dtype"]


def preferred_dtype() -> torch.dtype:
    """The half-precision dtype tests should use here: fp16 on CUDA, bf16 on CPU, else fp32."""
    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return torch.float16
    if accelerator.is_bf16_supported():
        return torch.bfloat16
    return torch.float32
