"""``deepspeed.runtime.fp16.loss_scaler``: DeepSpeed's loss scalers are zengine's
(`zengine.StaticLossScaler`, `zengine.DynamicLossScaler`: DeepSpeed's ``update_scale`` rules),
built with DeepSpeed's constructors and its ``CreateLossScaler``.

Unlike DeepSpeed's static ``LossScaler``, whose ``has_overflow`` always answers False, zengine's
really checks: a step with inf gradients is skipped whatever the scale.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import zengine
from zengine import StaticLossScaler as LossScaler

__all__ = [
    "CONSECUTIVE_HYSTERESIS",
    "DELAYED_SHIFT",
    "INITIAL_LOSS_SCALE",
    "MIN_LOSS_SCALE",
    "SCALE_WINDOW",
    "CreateLossScaler",
    "DynamicLossScaler",
    "LossScaler",
]

# the keys of CreateLossScaler's dynamic_loss_args: DynamicLossScaler's arguments
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


class DynamicLossScaler(zengine.DynamicLossScaler):
    """zengine's dynamic loss scale, made with DeepSpeed's constructor: its order of arguments
    (``scale_window`` second, where zengine's is ``scale_factor``), each required, and `dtype`,
    which DeepSpeed reads only to word its log line. The scale factor is 2."""

    def __init__(
        self,
        init_scale: float,
        scale_window: int,
        min_scale: float,
        delayed_shift: int,
        consecutive_hysteresis: bool,
        raise_error_at_min_scale: bool = True,
        dtype: torch.dtype = torch.half,
    ) -> None:
        super().__init__(
            init_scale=init_scale,
            scale_window=scale_window,
            min_scale=min_scale,
            delayed_shift=delayed_shift,
            consecutive_hysteresis=consecutive_hysteresis,
            raise_error_at_min_scale=raise_error_at_min_scale,
        )
        self.dtype = dtype  # DeepSpeed's attribute

    def has_overflow_serial(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Whether any of `params`' gradients holds an inf or a nan (DeepSpeed's name)."""
        return self.has_overflow(p.grad for p in params)


def CreateLossScaler(
    dtype: torch.dtype,
    static_loss_scale: float,
    dynamic_scaling: bool,
    dynamic_loss_args: Mapping[str, Any] | None,
) -> zengine.StaticLossScaler | DynamicLossScaler:
    """DeepSpeed's factory: a `DynamicLossScaler` of `dynamic_loss_args` (keyed by the names
    above) for fp16 with `dynamic_scaling`; else a `LossScaler` of `static_loss_scale` for fp16
    and of 1 (no scaling) for other dtypes.

    Raises:
        ValueError: dynamic fp16 scaling without `dynamic_loss_args`.
    """
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError(
                "CreateLossScaler(dynamic_loss_args=None): dynamic loss scaling needs its "
                f"arguments ({INITIAL_LOSS_SCALE}, {SCALE_WINDOW}, {MIN_LOSS_SCALE}, "
                f"{DELAYED_SHIFT}, {CONSECUTIVE_HYSTERESIS})"
            )
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(static_loss_scale if dtype == torch.half else 1.0)
