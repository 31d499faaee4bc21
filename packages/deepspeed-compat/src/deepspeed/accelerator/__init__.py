"""``deepspeed.accelerator``: zcomm's accelerator (CUDA when present, else the CPU)."""

from zcomm import Accelerator, get_accelerator

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported"]


def is_current_accelerator_supported() -> bool:
    """Whether zstack runs on the accelerator in use: CUDA and the CPU, the only two zcomm
    picks, both are."""
    return True
