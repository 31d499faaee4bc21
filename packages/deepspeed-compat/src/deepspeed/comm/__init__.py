"""``deepspeed.comm``: zcomm, torch.distributed underneath (NCCL on GPU, gloo on CPU)."""

import torch.distributed as dist

from zcomm import *  # noqa: F403 - DeepSpeed's deepspeed.comm is zcomm's whole surface
from zcomm import __all__ as _zcomm_names
from zcomm import destroy

__all__ = [*_zcomm_names, "destroy_process_group"]


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """DeepSpeed's: tear down `group`, or without one the whole world (zcomm's `destroy`,
    which also forgets zcomm's groups made on it)."""
    if group is None:
        destroy()
    else:
        dist.destroy_process_group(group)
