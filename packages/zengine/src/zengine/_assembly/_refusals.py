"""What `initialize` refuses as DeepSpeed's does, where the config alone cannot say.

Each raises `UsageError` (DeepSpeed's ``ZeRORuntimeException``, also an ``AssertionError`` as
DeepSpeed's asserts are), naming the config key that decides, before the model is changed; an
optimizer a caller's factory builds is checked once built, as DeepSpeed checks it.
"""

from __future__ import annotations

import torch

from zengine._config import EngineConfig
from zengine._errors import UsageError
from zengine._optim import ALIGNMENT
from zengine.ops.adam import DeepSpeedCPUAdam
from zengine.ops.lion import DeepSpeedCPULion

__all__ = ["check_allgather_bucket_size", "check_offloaded_optimizer", "checked_optimizer"]

_HOST_OPTIMIZERS = (DeepSpeedCPUAdam, DeepSpeedCPULion)  # DeepSpeed's, exactly these two


def check_offloaded_optimizer(optimizer: torch.optim.Optimizer, cfg: EngineConfig) -> None:
    """With ``offload_optimizer`` and ``zero_force_ds_cpu_optimizer`` (DeepSpeed's default), an
    optimizer from the caller must be one of DeepSpeed's host optimizers (runtime/engine.py,
    ``_configure_optimizer``): another steps the masters on the host slowly."""
    offload = cfg.zero_optimization.offload_optimizer.device
    if offload == "none" or not cfg.zero_force_ds_cpu_optimizer:
        return
    if isinstance(optimizer, _HOST_OPTIMIZERS):
        return
    raise UsageError(
        f"initialize(optimizer=...): ZeRO-Offload (zero_optimization.offload_optimizer.device "
        f"{offload!r}) with a client optimizer ({type(optimizer).__name__}), which steps the "
        "masters on the host slowly: use zengine.ops.adam.DeepSpeedCPUAdam (or "
        "zengine.ops.lion.DeepSpeedCPULion), or the config's 'optimizer' section, or set "
        '"zero_force_ds_cpu_optimizer": false to step them with this one'
    )


def checked_optimizer(optimizer: torch.optim.Optimizer, cfg: EngineConfig) -> torch.optim.Optimizer:
    """`optimizer`, a torch optimizer a caller's factory built, once
    `check_offloaded_optimizer` lets it through (DeepSpeed checks what the factory returns)."""
    # checked at run time too: an untyped factory may return anything, and it is passed on
    if isinstance(optimizer, torch.optim.Optimizer):
        check_offloaded_optimizer(optimizer, cfg)
    return optimizer


def check_allgather_bucket_size(cfg: EngineConfig) -> None:
    """Stages 1 and 2: ``allgather_bucket_size`` a multiple of the partitions' alignment, as
    DeepSpeed's ZeRO optimizer asserts (runtime/zero/stage_1_and_2.py, at its
    ``nccl_start_alignment_factor``). zengine gathers each group in one collective, so the size
    itself changes nothing here; the value DeepSpeed refuses is refused all the same."""
    size = cfg.zero_optimization.allgather_bucket_size
    if cfg.zero_stage in (1, 2) and size % ALIGNMENT:
        raise UsageError(
            f"zero_optimization.allgather_bucket_size: allgather_bucket_size must be a multiple "
            f"of nccl_start_alignment_factor, {ALIGNMENT} (got {size}; ZeRO stages 1 and 2 "
            f"start each rank's partition on a multiple of {ALIGNMENT} elements)"
        )
