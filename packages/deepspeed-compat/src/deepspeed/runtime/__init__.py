"""``deepspeed.runtime``: the engine, its config, LR schedules, loss scalers, checkpoint engines,
ZeRO and pipeline modules, on zengine.

Its submodules are imported here, as DeepSpeed's package imports them, so attribute paths such
as ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` work after a bare ``import deepspeed``.
"""

from deepspeed.runtime import (
    activation_checkpointing,
    base_optimizer,
    bf16_optimizer,
    checkpoint_engine,
    config,
    engine,
    fp16,
    lr_schedules,
    pipe,
    precision_config,
    sequence_parallel,
    torch_autocast,
    utils,
    zero,
)

__all__ = [
    "activation_checkpointing",
    "base_optimizer",
    "bf16_optimizer",
    "checkpoint_engine",
    "config",
    "engine",
    "fp16",
    "lr_schedules",
    "pipe",
    "precision_config",
    "sequence_parallel",
    "torch_autocast",
    "utils",
    "zero",
]
