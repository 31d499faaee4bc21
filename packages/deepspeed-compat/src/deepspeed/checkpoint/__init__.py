"""``deepspeed.checkpoint``: DeepSpeed's names of its checkpoint files and keys (`constants`,
also here at the top, as DeepSpeed's ``from .constants import *``), the helpers of `utils`;
``deepspeed.checkpoint.ds_to_universal`` (imported on its own, as DeepSpeed's) writes a zstack
checkpoint as DeepSpeed's universal checkpoint."""

from deepspeed.checkpoint import constants, utils
from deepspeed.checkpoint.constants import *  # noqa: F403 - DeepSpeed's names, here too
from deepspeed.checkpoint.constants import __all__ as _constant_names
from deepspeed.checkpoint.utils import (
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)

__all__ = [
    *_constant_names,
    "constants",
    "get_layer_ckpt_name_for_rank",
    "get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank",
    "utils",
]
