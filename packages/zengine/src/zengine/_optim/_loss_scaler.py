"""fp16 loss scaling: a fixed scale, or DeepSpeed's dynamic scale with hysteresis.

Multiplying the loss by a large scale before backward keeps small fp16 gradients from
flushing to zero; the optimizer divides it back out. `DynamicLossScaler` rides the edge:
each overflow (an inf or nan in the gradients, found by `LossScalerBase.has_overflow`) skips
the step and lowers the scale, and every `scale_window` clean steps raise it again. The
``update_scale`` rules are DeepSpeed's (``deepspeed/runtime/fp16/loss_scaler.py``).

How a DeepSpeed config's ``"fp16"`` section (DeepSpeed's defaults in brackets) maps here:

* ``loss_scale`` [0]: 0 means `DynamicLossScaler`, > 0 means ``StaticLossScaler(loss_scale)``;
* ``initial_scale_power`` [16]: ``init_scale=2**initial_scale_power``;
* ``loss_scale_window`` [1000]: ``scale_window``;
* ``hysteresis`` [2]: ``delayed_shift`` (the config's default is 2, the constructor's 1, as
  in DeepSpeed);
* ``min_loss_scale`` [1]: ``min_scale``;
* ``consecutive_hysteresis`` [false]: ``consecutive_hysteresis``.

``scale_factor`` (2) and ``raise_error_at_min_scale`` (True) have no config key in DeepSpeed.
At ZeRO stage 0 DeepSpeed scales with its ``FP16_Optimizer``, which never stops at the minimum:
the engine clears ``raise_error_at_min_scale`` there. Its raises come at the same steps as its
ZeRO stages' (checked against DeepSpeed 0.19.8 by ``test_loss_scale_follows_deepspeeds``).
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

import torch

import zcomm

__all__ = ["DynamicLossScaler", "LossScalerBase", "MinLossScaleError", "StaticLossScaler"]

_log = logging.getLogger(__name__)


class MinLossScaleError(RuntimeError):
    """Gradients overflowed again with the loss scale already at its minimum.

    Training cannot make progress: every step is skipped. DeepSpeed stops the run here too.
    """


def _check_positive(cls: str, name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{cls}({name}=...): expected a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{cls}({name}=...): must be finite and > 0, got {value!r}")
    return float(value)


def _check_non_negative(cls: str, name: str, value: float) -> float:
    # 0 is allowed because DeepSpeed's config allows min_loss_scale 0 (no floor).
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{cls}({name}=...): expected a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{cls}({name}=...): must be finite and >= 0, got {value!r}")
    return float(value)


def _check_count(cls: str, name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{cls}({name}=...): expected an int >= 1, got {value!r}")
    return value


def _is_rank_zero() -> bool:
    return not zcomm.is_initialized() or zcomm.get_rank() == 0


class LossScalerBase(ABC):
    """What both scalers offer: the current scale, scaling a loss, the overflow check, state."""

    dynamic: bool = False

    def __init__(self, cur_scale: float) -> None:
        self.cur_scale = cur_scale

    @property
    def loss_scale(self) -> float:
        """The scale to multiply the next loss by."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the current scale: call ``backward()`` on this, not on `loss`."""
        return loss * self.loss_scale

    def has_overflow(self, tensors: Iterable[torch.Tensor | None]) -> bool:
        """Whether any of `tensors` (typically gradients) holds an inf or a nan.

        ``None`` entries (parameters without a gradient) are skipped. The per-tensor checks stay
        on the device; their results are read back once per device, not once per tensor, so a
        model of many parameters pays one host synchronization. This rank's answer only: under
        data parallelism the caller reduces it across ranks, so all of them skip together.
        Unlike DeepSpeed's static scaler (which always answers False), both scalers really
        check, since a step with inf gradients must be skipped whatever the scale.
        """
        flags: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            flags.setdefault(t.device, []).append(torch.isfinite(t).all())
        return any(not bool(torch.stack(found).all()) for found in flags.values())

    @abstractmethod
    def update_scale(self, overflow: bool) -> None:
        """Account for one step, which overflowed or not."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The scale and counters, to checkpoint; the constructor's settings are not included."""

    @abstractmethod
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what `state_dict` saved."""

    def _state(self, state_dict: Mapping[str, Any], keys: tuple[str, ...]) -> list[Any]:
        missing = [key for key in keys if key not in state_dict]
        if missing:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: missing {missing} "
                f"(got keys {sorted(state_dict)})"
            )
        return [state_dict[key] for key in keys]


class StaticLossScaler(LossScalerBase):
    """A loss scale that never changes (DeepSpeed's ``LossScaler``; ``fp16.loss_scale`` > 0)."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__(_check_positive(type(self).__name__, "scale", scale))

    def update_scale(self, overflow: bool) -> None:
        """Nothing to adjust: an overflowing step is skipped and the scale stays."""

    def state_dict(self) -> dict[str, Any]:
        """``{"cur_scale": ...}``."""
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the scale."""
        (scale,) = self._state(state_dict, ("cur_scale",))
        self.cur_scale = float(scale)


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic loss scale (``fp16.loss_scale`` = 0).

    Args:
        init_scale: the first scale tried.
        scale_factor: the scale is divided by this on an overflow and multiplied by it after
            `scale_window` clean steps.
        scale_window: clean steps, counted from the last overflow, between raises.
        min_scale: the scale never goes below this (0: no floor).
        delayed_shift: hysteresis: how many overflows it takes to lower the scale. Lowering
            does not refill it, so once spent every overflow lowers the scale until a raise
            (or, with `consecutive_hysteresis`, any clean step) refills it.
        consecutive_hysteresis: refill the hysteresis on every clean step, so only
            `delayed_shift` overflows in a row lower the scale.
        raise_error_at_min_scale: raise `MinLossScaleError` when an overflow would lower a
            scale already at `min_scale`; if False, keep training at `min_scale`.

    A window's clean steps count from the step after the last overflow (and from the second
    step at the start), as DeepSpeed counts them at every ZeRO stage: the first raise comes
    after `scale_window` + 1 clean steps, each later one `scale_window` clean steps after it.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        name = type(self).__name__
        super().__init__(_check_positive(name, "init_scale", init_scale))
        self.scale_factor = _check_positive(name, "scale_factor", scale_factor)
        if self.scale_factor <= 1.0:
            raise ValueError(f"{name}(scale_factor=...): must be > 1, got {scale_factor!r}")
        self.scale_window = _check_count(name, "scale_window", scale_window)
        self.min_scale = _check_non_negative(name, "min_scale", min_scale)
        self.delayed_shift = _check_count(name, "delayed_shift", delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        # Steps seen so far, and the step of the last overflow (-1: none yet, so the first
        # raise comes after scale_window clean steps from the start).
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    def update_scale(self, overflow: bool) -> None:
        """Account for one step: lower the scale on an overflow, raise it after a clean window.

        Raises:
            MinLossScaleError: an overflow with the scale already at `min_scale`, if
                `raise_error_at_min_scale`.
        """
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise MinLossScaleError(
                        "gradients overflowed with the loss scale already at its minimum "
                        f"({self.min_scale}); it cannot be lowered further. Lower the learning "
                        "rate, use bf16, or set min_loss_scale lower."
                    )
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                # Debug only: the optimizer already reports each skipped step; this says why
                # the scale did or did not move.
                if _is_rank_zero():
                    _log.debug(
                        "OVERFLOW! Skipping step. Loss scale %s, reducing to %s",
                        self.cur_scale,
                        next_scale,
                    )
                self.cur_scale = next_scale
            else:
                if _is_rank_zero():
                    _log.debug(
                        "OVERFLOW! Skipping step. Loss scale %s kept, hysteresis %d -> %d",
                        self.cur_scale,
                        self.cur_hysteresis,
                        self.cur_hysteresis - 1,
                    )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            # DeepSpeed's `stable_interval`: the step right after an overflow does not count
            clean = self.cur_iter - self.last_overflow_iter - 1
            if clean > 0 and clean % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        """The scale, the step counters and the hysteresis left."""
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the scale and counters; the settings stay the constructor's (the config's)."""
        scale, cur_iter, last_overflow, hysteresis = self._state(
            state_dict, ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
        )
        self.cur_scale = float(scale)
        self.cur_iter = int(cur_iter)
        self.last_overflow_iter = int(last_overflow)
        self.cur_hysteresis = int(hysteresis)
