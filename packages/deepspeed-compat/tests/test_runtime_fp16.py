"""``deepspeed.runtime.fp16``: DeepSpeed's loss scalers, built with its constructors, are
zengine's and scale as zengine's do; its fp16 optimizers are zengine's ZeRO optimizer."""

from __future__ import annotations

import pytest
import torch

import zengine
from deepspeed.runtime.fp16 import fused_optimizer, loss_scaler, unfused_optimizer
from deepspeed.runtime.fp16.loss_scaler import (
    CONSECUTIVE_HYSTERESIS,
    DELAYED_SHIFT,
    INITIAL_LOSS_SCALE,
    MIN_LOSS_SCALE,
    SCALE_WINDOW,
    CreateLossScaler,
    DynamicLossScaler,
    LossScaler,
)


@pytest.mark.parametrize(
    ("delayed_shift", "overflows", "scales"),
    [
        # DeepSpeed 0.19.8's DynamicLossScaler(256, 3, 64, ...) given these steps, run there:
        # a raise after 3 clean steps counted from the one after the last overflow, hysteresis
        # 2 spent by one overflow and not refilled without a raise, the floor at 64
        (1, [False] * 8, [256, 256, 256, 512, 512, 512, 1024, 1024]),
        (
            2,
            [True, True, False, False, False, True, True, True, True, True],
            [256, 128, 128, 128, 128, 64, 64, 64, 64, 64],
        ),
    ],
)
def test_deepspeeds_dynamic_scaler_scales_as_deepspeeds(
    delayed_shift: int, overflows: list[bool], scales: list[float]
) -> None:
    # DeepSpeed's order: init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis
    scaler = DynamicLossScaler(256.0, 3, 64.0, delayed_shift, False, False)
    assert isinstance(scaler, zengine.DynamicLossScaler)
    assert (scaler.dynamic, scaler.dtype, scaler.scale_factor) == (True, torch.half, 2.0)
    seen = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        seen.append(scaler.cur_scale)
    assert seen == scales
    at_floor = DynamicLossScaler(64.0, 3, 64.0, 1, False)  # raise_error_at_min_scale: True
    with pytest.raises(zengine.MinLossScaleError, match="minimum"):
        at_floor.update_scale(True)


def test_the_overflow_check_reads_the_gradients() -> None:
    scaler = DynamicLossScaler(1.0, 10, 1.0, 1, False)
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    params[0].grad = torch.ones(2)  # params[1] has no gradient
    assert not scaler.has_overflow_serial(params)
    params[2].grad = torch.tensor([1.0, float("nan")])
    assert scaler.has_overflow_serial(params)


def test_create_loss_scaler_as_deepspeeds_factory() -> None:
    args = {
        INITIAL_LOSS_SCALE: 2.0**16,
        SCALE_WINDOW: 1000,
        MIN_LOSS_SCALE: 1.0,
        DELAYED_SHIFT: 2,
        CONSECUTIVE_HYSTERESIS: False,
    }
    dynamic = CreateLossScaler(torch.half, 1.0, True, args)
    assert isinstance(dynamic, DynamicLossScaler)
    assert (dynamic.cur_scale, dynamic.scale_window, dynamic.delayed_shift) == (2.0**16, 1000, 2)
    static = CreateLossScaler(torch.half, 128.0, False, None)
    assert isinstance(static, LossScaler)
    assert (static.dynamic, static.loss_scale) == (False, 128.0)
    for dtype in (torch.bfloat16, torch.float32):  # no scaling outside fp16, whatever is asked
        unscaled = CreateLossScaler(dtype, 128.0, True, args)
        assert isinstance(unscaled, LossScaler)
        assert unscaled.cur_scale == 1.0
    with pytest.raises(ValueError, match=r"dynamic_loss_args=None.*init_scale"):
        CreateLossScaler(torch.half, 1.0, True, None)


def test_the_static_scaler_and_the_fp16_optimizers_are_zengines() -> None:
    assert LossScaler is zengine.StaticLossScaler
    assert LossScaler().loss_scale == 1.0  # DeepSpeed's default scale
    # the optimizer classes are isinstance tests of zengine's (test_package.py's kinds)
    assert issubclass(zengine.ZeroOptimizer, fused_optimizer.FP16_Optimizer)
    assert issubclass(zengine.ZeroOptimizer, unfused_optimizer.FP16_UnfusedOptimizer)
    assert loss_scaler.DynamicLossScaler is DynamicLossScaler
