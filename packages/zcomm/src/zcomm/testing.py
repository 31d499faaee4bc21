"""The distributed test harness: `DistributedTest`, `preferred_dtype` and `setup_serial_env`
(DeepSpeed's names)."""

from __future__ import annotations

import os
import socket

import torch

from zcomm._accelerator import get_accelerator
from zcomm._dist_test import DistributedTest

__all__ = ["DistributedTest", "preferred_dtype", "setup_serial_env"]


def preferred_dtype() -> torch.dtype:
    """The half-precision dtype tests should use here: fp16 on CUDA, bf16 on CPU, else fp32."""
    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return torch.float16
    if accelerator.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def setup_serial_env() -> None:
    """The environment of a world of one (DeepSpeed's test helper): rank 0 of 1, a free port.
    Inside a `DistributedTest` the world is already up, and this changes nothing that matters."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0", RANK="0", WORLD_SIZE="1"
    )
