"""``deepspeed.comm``: zcomm, torch.distributed underneath (NCCL on GPU, gloo on CPU)."""

from zcomm import *  # noqa: F403 - DeepSpeed's deepspeed.comm is zcomm's whole surface
from zcomm import __all__ as __all__
