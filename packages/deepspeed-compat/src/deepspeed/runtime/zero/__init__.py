"""``deepspeed.runtime.zero``: ZeRO-3's parameters (zpartition) and its configuration enums."""

from deepspeed.runtime.zero import (
    linear,
    offload_config,
    offload_states,
    partition_parameters,
    stage3,
    stage_1_and_2,
    utils,
)
from deepspeed.zero import MiCS_Init
from zengine.zero import *  # noqa: F403 - deepspeed.zero's names, here too as in DeepSpeed
from zengine.zero import __all__ as _zero_names

__all__ = [
    *_zero_names,
    "MiCS_Init",
    "linear",
    "offload_config",
    "offload_states",
    "partition_parameters",
    "stage3",
    "stage_1_and_2",
    "utils",
]
