"""``deepspeed.zero``: `Init`, `GatheredParameters` and external parameters (zpartition's)."""

from deepspeed.runtime.zero.partition_parameters import MiCS_Init
from zengine.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
    unwrap_model_for_generation,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
]
