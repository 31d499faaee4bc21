"""``deepspeed.accelerator``: zcomm's accelerator (CUDA when present, else the CPU)."""

from zcomm import Accelerator, get_accelerator

__all__ = ["Accelerator", "get_accelerator"]
