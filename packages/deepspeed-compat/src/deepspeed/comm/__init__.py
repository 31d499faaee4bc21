"""``deepspeed.comm``: zcomm, torch.distributed underneath (NCCL on GPU, gloo on CPU)."""

from typing import Any

import torch.distributed as dist

import zcomm
from deepspeed.comm._accelerate_world import tell_accelerate_the_backend
from zcomm import *  # noqa: F403 - DeepSpeed's deepspeed.comm is zcomm's whole surface
from zcomm import __all__ as _zcomm_names
from zcomm import destroy

__all__ = [*_zcomm_names, "destroy_process_group"]


def init_distributed(dist_backend: str | None = None, **kwargs: Any) -> None:  # type: ignore[no-redef]  # zcomm's, wrapped
    """zcomm's `init_distributed`, with DeepSpeed's arguments; it also gives Accelerate's
    process state, when it is being made for DeepSpeed on a machine without an accelerator,
    the backend the group runs on ([Note: Accelerate's world on CPU])."""
    zcomm.init_distributed(dist_backend=dist_backend, **kwargs)
    tell_accelerate_the_backend(dist_backend or kwargs.get("backend"))


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """DeepSpeed's: tear down `group`, or without one the whole world (zcomm's `destroy`,
    which also forgets zcomm's groups made on it)."""
    if group is None:
        destroy()
    else:
        dist.destroy_process_group(group)
