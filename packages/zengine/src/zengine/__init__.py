"""initialize(), the ZeRO engine and optimizer, mixed precision, offload, pipelines, checkpoints.

``import zengine`` stands in for ``import deepspeed``: ``zengine.initialize`` returns
``(engine, optimizer, dataloader, lr_scheduler)``; ``zengine.zero`` holds ``Init`` and
``GatheredParameters``; ``zengine.utils`` the ``safe_get_*`` functions; ``zengine.checkpointing``
DeepSpeed's activation checkpointing; ``zengine.ops`` its optimizer classes.
"""

from zcomm import init_distributed
from zengine import checkpointing, ops, pipe, utils, zero
from zengine.__about__ import __version__
from zengine._agreement import RankMismatchError
from zengine._checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointTagError,
    ClientStateError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from zengine._config import ConfigError, EngineConfig, add_config_arguments, load_config
from zengine._engine import Engine
from zengine._errors import UsageError
from zengine._estimate import (
    MemoryEstimate,
    estimate_memory,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from zengine._initialize import initialize
from zengine._load_safetensors import load_safetensors
from zengine._offload import get_state_devices
from zengine._optim import (
    DynamicLossScaler,
    LRRangeTest,
    MinLossScaleError,
    OneCycle,
    StaticLossScaler,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    ZeroOptimizer,
    get_comm_dtype,
    has_comm_dtype,
)
from zengine.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)

DeepSpeedConfigError = ConfigError  # DeepSpeed's name, which users catch

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointTagError",
    "ClientStateError",
    "ConfigError",
    "CorruptCheckpointError",
    "DeepSpeedConfigError",
    "DynamicLossScaler",
    "Engine",
    "EngineConfig",
    "LRRangeTest",
    "MemoryEstimate",
    "MinLossScaleError",
    "OneCycle",
    "RankMismatchError",
    "StaticLossScaler",
    "UnsafeCheckpointError",
    "UsageError",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroOptimizer",
    "__version__",
    "add_config_arguments",
    "checkpointing",
    "estimate_memory",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "get_comm_dtype",
    "get_state_devices",
    "has_comm_dtype",
    "init_distributed",
    "initialize",
    "load_config",
    "load_safetensors",
    "ops",
    "pipe",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "utils",
    "zero",
]
