"""``deepspeed.runtime.zero.linear``: DeepSpeed's ZeRO-3 stand-ins for ``nn.Linear``, which are
torch's own linear here.

DeepSpeed replaces ``nn.Linear``'s function under ZeRO-3 (``memory_efficient_linear``) so that
its backward gathers a released weight again. zpartition needs no replacement: its hooks gather
a module's parameters around the module's own forward and backward ([Note: hooks] in
zpartition/_hooks.py), whatever function the module calls. So ``LinearModuleForZeroStage3`` is
``torch.nn.Linear`` itself, and ``zero3_linear_wrap`` / ``LinearFunctionForZeroStage3.apply``
are ``torch.nn.functional.linear``: autograd records torch's own backward (``AddmmBackward0``),
not a DeepSpeed function. The autocast decorators are torch's, for the accelerator's device, as
DeepSpeed makes them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Linear as LinearModuleForZeroStage3

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import noop_decorator

__all__ = [
    "LinearFunctionForZeroStage3",
    "LinearModuleForZeroStage3",
    "autocast_custom_bwd",
    "autocast_custom_fwd",
    "noop_decorator",
    "zero3_linear_wrap",
]

_DEVICE = get_accelerator().device_name()
# DeepSpeed's names for torch.amp.custom_fwd/custom_bwd bound to the accelerator's device
autocast_custom_fwd: Callable[..., Any] = functools.partial(
    torch.amp.custom_fwd, device_type=_DEVICE
)
autocast_custom_bwd: Callable[..., Any] = functools.partial(
    torch.amp.custom_bwd, device_type=_DEVICE
)


def zero3_linear_wrap(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``input @ weight.T + bias``: torch's ``nn.functional.linear``, under DeepSpeed's name."""
    return torch.nn.functional.linear(input, weight, bias)


class LinearFunctionForZeroStage3:
    """DeepSpeed's ``autograd.Function`` for ZeRO-3's linear: here only its ``apply``, which is
    torch's linear (`zero3_linear_wrap`); there is no DeepSpeed backward to record."""

    apply = staticmethod(zero3_linear_wrap)
