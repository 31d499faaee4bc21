"""``torch_autocast``: PyTorch's native mixed precision under the engine (DeepSpeed's section).

The parameters, the masters and the optimizer state stay in the model's dtype (fp32); the
engine runs the model's forward under ``torch.autocast``, and the gradients of the modules
listed as lower-precision safe (Linear and Conv by default) may be reduced in the autocast
dtype: each of their parameters gets a ``comm_dtype`` attribute, which the gradient buckets
of every stage read (zpartition's at stage 3, which also all-gathers those parameters in it
for the forward and backward passes: the values autocast computes with, in half the bytes).
With fp16, the loss is scaled dynamically, by torch's GradScaler rules
(`autocast_loss_scaler`).

An autocast the caller opened around ``engine(x)`` is left as it is when the section is off
(DeepSpeed turns it off inside the engine, with a warning), and overridden by the section's
dtype when it is on.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zengine._config import ConfigError, EngineConfig
from zengine._optim._loss_scaler import DynamicLossScaler

__all__ = [
    "COMM_DTYPE_ATTR",
    "autocast_dtype",
    "autocast_loss_scaler",
    "forward_autocast",
    "get_comm_dtype",
    "has_comm_dtype",
    "mark_comm_dtypes",
]

COMM_DTYPE_ATTR = "comm_dtype"
"""The parameter attribute naming the dtype its gradient is reduced in (DeepSpeed's
``PARAM_COMM_DTYPE_ATTR_NAME``)."""

DEFAULT_SAFE_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def has_comm_dtype(param: torch.Tensor) -> bool:
    """Whether `param` has a ``comm_dtype`` of its own (``torch_autocast`` gave it one)."""
    return isinstance(getattr(param, COMM_DTYPE_ATTR, None), torch.dtype)


def get_comm_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype `param`'s gradient is reduced in under ``torch_autocast``: its ``comm_dtype``,
    else its own dtype (DeepSpeed's ``get_comm_dtype``)."""
    return getattr(param, COMM_DTYPE_ATTR) if has_comm_dtype(param) else param.dtype


def autocast_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype | None:
    """What the forward computes in under ``torch_autocast``; None when the section is off."""
    section = cfg.torch_autocast
    if not section.enabled:
        return None
    if section.dtype is None:
        return torch.get_autocast_dtype(device.type)
    return _TORCH_DTYPES[section.dtype]


def forward_autocast(
    dtype: torch.dtype | None, device: torch.device
) -> contextlib.AbstractContextManager[Any]:
    """The context a forward runs in: ``torch.autocast`` in `dtype`, or nothing (None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def safe_module_classes(names: Sequence[str] | None) -> tuple[type[nn.Module], ...]:
    """The classes ``torch_autocast.lower_precision_safe_modules`` names (None: the default)."""
    if names is None:
        return DEFAULT_SAFE_MODULES
    classes, problems = [], []
    key = "torch_autocast.lower_precision_safe_modules"
    for i, name in enumerate(names):
        package, _, attr = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(package), attr, None) if package else None
        except ImportError as error:
            problems.append(f"{key}[{i}]: cannot import {package!r} for {name!r}: {error}")
            continue
        if not (isinstance(found, type) and issubclass(found, nn.Module)):
            problems.append(
                f"{key}[{i}]: {name!r} is not a module class (write its qualified name, "
                "such as 'torch.nn.Linear')"
            )
            continue
        classes.append(found)
    if problems:
        raise ConfigError(problems)
    return tuple(classes)


def mark_comm_dtypes(model: nn.Module, cfg: EngineConfig, device: torch.device) -> None:
    """Give the parameters of the lower-precision-safe modules their ``comm_dtype`` (the
    autocast dtype), before the gradient buckets are cut; nothing when the section is off."""
    dtype = autocast_dtype(cfg, device)
    if dtype is None:
        return
    classes = safe_module_classes(cfg.torch_autocast.lower_precision_safe_modules)
    for module in model.modules():
        if type(module) in classes:  # an exact match, as DeepSpeed's
            for p in module.parameters(recurse=False):
                setattr(p, COMM_DTYPE_ATTR, dtype)


def autocast_loss_scaler(cfg: EngineConfig, device: torch.device) -> DynamicLossScaler | None:
    """fp16 autocast without the ``fp16`` section: torch's GradScaler rules (start at 2**16,
    halve on an overflow and skip the step, double after 2000 clean steps), as DeepSpeed's
    GradScaler; None otherwise."""
    if cfg.fp16_enabled or autocast_dtype(cfg, device) != torch.float16:
        return None
    return DynamicLossScaler(
        init_scale=2.0**16,
        scale_window=2000,
        min_scale=0.0,  # no floor, as GradScaler
        delayed_shift=1,
        raise_error_at_min_scale=False,
    )
