"""initialize(), the ZeRO engine and optimizer, mixed precision, offload, pipelines, checkpoints.

``import zengine`` stands in for ``import deepspeed``: ``zengine.initialize`` returns
``(engine, optimizer, dataloader, lr_scheduler)``; ``zengine.zero`` holds ``Init`` and
``GatheredParameters``; ``zengine.utils`` the ``safe_get_*`` functions.
"""

from zengine import utils, zero
from zengine.__about__ import __version__
from zengine._config import ConfigError, EngineConfig, load_config
from zengine._engine import Engine
from zengine._initialize import initialize
from zengine._zero_optimizer import ZeroOptimizer
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

__all__ = [
    "ConfigError",
    "Engine",
    "EngineConfig",
    "ZeroOptimizer",
    "__version__",
    "initialize",
    "load_config",
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
