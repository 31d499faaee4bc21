"""``deepspeed.runtime.zero``: ZeRO-3's parameters (zpartition) and its configuration enums."""

from deepspeed.runtime.zero import offload_config, offload_states, partition_parameters, utils
from deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    MiCS_Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "ZeroParamStatus",
    "offload_config",
    "offload_states",
    "partition_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
    "utils",
]
