"""The distributed test harness: `DistributedTest`, `DistributedFixture`, `get_master_port`,
`preferred_dtype` and `setup_serial_env` (DeepSpeed's names)."""

from __future__ import annotations

import os

import torch

from zcomm._accelerator import get_accelerator
from zcomm._dist_test import DistributedFixture, DistributedTest
from zcomm._pool import free_port

__all__ = [
    "DistributedFixture",
    "DistributedTest",
    "get_master_port",
    "preferred_dtype",
    "setup_serial_env",
]


def get_master_port(base_port: int = 29500, port_range_size: int = 1000) -> str:
    """A TCP port free now, for a rendezvous a test starts itself (DeepSpeed's helper; its
    range arguments are taken and not needed: the system picks a free port)."""
    del base_port, port_range_size
    return str(free_port())


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
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=get_master_port(),
        LOCAL_RANK="0",
        RANK="0",
        WORLD_SIZE="1",
    )
