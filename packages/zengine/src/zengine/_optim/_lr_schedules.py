"""DeepSpeed's learning-rate schedules: `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`,
`LRRangeTest` and `OneCycle`.

Same constructor arguments, same formulas and same stepping protocol as
``deepspeed.runtime.lr_schedules``, so a config's ``"scheduler"`` section means the same thing
here (`build_scheduler` turns one into a schedule). Step ``i`` is the ``i``-th call of
``step()``; with ``W`` the number of warm-up steps (at least 2, as DeepSpeed forces) the
warm-up factor is

* ``log``: ``log(i + 1) / log(W)``, reaching 1 at ``i = W - 1``;
* ``linear``: ``i / W``, reaching 1 at ``i = W``.

`WarmupLR` holds the learning rate at ``min_lr + (max_lr - min_lr) * factor`` and then at
``max_lr`` (each group's own lr when `warmup_max_lr` is not given). `WarmupDecayLR` then
decays linearly back to ``min_lr`` at ``total_num_steps``.
`WarmupCosineLR` works in ratios of each group's own learning rate: it warms from
``warmup_min_ratio`` to 1 and then follows a half cosine down to ``cos_min_ratio``, reached at
step ``total_num_steps - 1``.

`LRRangeTest` multiplies each group's `lr_range_test_min_lr` by ``1 + rate * (i + 1) / size``
(the quotient floored with `lr_range_test_staircase`). `OneCycle` goes from `cycle_min_lr` up to
`cycle_max_lr` over `cycle_first_step_size` steps and back over `cycle_second_step_size`, moving
Adam's first beta the other way between `cycle_max_mom` and `cycle_min_mom`; after the cycle the
lr is ``cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size)`` at the k-th step past it
(held at `cycle_min_lr` when either is 0) and the beta ``cycle_max_mom * (1 + decay_mom_rate *
k / decay_step_size)``. As DeepSpeed's, it sets the second beta to 0.99, and a stair count
holds the lr and beta flat over each of that many equal parts of its half of the cycle.

A group whose lr is a tensor (torch's capturable and compiled optimizers) keeps that tensor: the
schedule fills it in place, so whoever holds it sees the new lr. As DeepSpeed 0.19.8's; unlike
DeepSpeed, bad arguments (an unknown `warmup_type` too) raise ``ValueError`` instead of being
logged and replaced.
"""

from __future__ import annotations

import inspect
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

__all__ = [
    "WARMUP_LINEAR_RATE",
    "WARMUP_LOG_RATE",
    "LRRangeTest",
    "OneCycle",
    "Scheduler",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "WarmupScheduler",
    "build_scheduler",
]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
_WARMUP_TYPES = (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE)

# DeepSpeed never warms up over fewer steps: log(1) would be a division by zero.
_MIN_WARMUP_STEPS = 2
_ONE_CYCLE_BETA2 = 0.99  # OneCycle's second beta, whatever the optimizer had (DeepSpeed's)

log = logging.getLogger("zengine")


class _HasParamGroups(Protocol):
    # Any torch optimizer, or a wrapper (ZeRO, fp16) that exposes its param groups.
    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class Scheduler(Protocol):
    """What an engine holds as its LR scheduler: a torch ``LRScheduler``, one of the schedules
    here, or a caller's own. The engine steps it (DeepSpeed's test for one: it has ``step``)
    and a checkpoint saves and restores its state."""

    def step(self) -> object: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _check_optimizer(cls: str, optimizer: object) -> _HasParamGroups:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not groups:
        raise TypeError(
            f"{cls}(optimizer=...): expected an optimizer with param_groups, "
            f"got {type(optimizer).__name__}"
        )
    return optimizer  # type: ignore[return-value]  # checked just above


def _check_warmup(cls: str, warmup_num_steps: int, warmup_type: str) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int):
        raise ValueError(f"{cls}(warmup_num_steps=...): expected an int, got {warmup_num_steps!r}")
    if warmup_num_steps < 1:
        raise ValueError(f"{cls}(warmup_num_steps=...): must be >= 1, got {warmup_num_steps}")
    if warmup_type not in _WARMUP_TYPES:
        raise ValueError(
            f"{cls}(warmup_type=...): expected one of {list(_WARMUP_TYPES)}, got {warmup_type!r}"
        )


def _check_steps(cls: str, name: str, value: object, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{cls}({name}=...): expected an int, got {value!r}")
    if value < least:
        raise ValueError(f"{cls}({name}=...): must be >= {least}, got {value}")
    return value


def _check_count(cls: str, name: str, value: object) -> int:
    # A stair count: any int, and 0 or less means none (DeepSpeed's flags default to -1).
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{cls}({name}=...): expected an int, got {value!r}")
    return value


def _check_total(cls: str, total_num_steps: int, warmup_num_steps: int) -> None:
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int):
        raise ValueError(f"{cls}(total_num_steps=...): expected an int, got {total_num_steps!r}")
    if total_num_steps < warmup_num_steps:
        raise ValueError(
            f"{cls}(total_num_steps=...): {total_num_steps} is less than "
            f"warmup_num_steps={warmup_num_steps}"
        )


def _per_group(cls: str, name: str, value: float | Sequence[float], num_groups: int) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"{cls}({name}=...): expected one value per param group ({num_groups}), "
                f"got {len(value)}"
            )
        return [float(v) for v in value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{cls}({name}=...): expected a number or a list, got {value!r}")
    return [float(value)] * num_groups


def _warmup_factor(warmup_type: str, inverse_log_warmup: float, step: int, steps: int) -> float:
    # The fraction of the warm-up done at `step` (< steps), 0 at step 0.
    if warmup_type == WARMUP_LOG_RATE:
        return inverse_log_warmup * math.log(step + 1)
    return step / steps


class WarmupScheduler(ABC):
    """What the schedules share: the stepping protocol and the checkpointed state.

    ``last_batch_iteration`` is the index of the last step taken (-1: none yet). A schedule
    built with ``last_batch_iteration=-1`` writes its step -1 learning rates into the optimizer
    at once, as DeepSpeed does; one built to resume (any other value) leaves them alone until
    the next `step`.
    """

    def __init__(self, optimizer: _HasParamGroups, last_batch_iteration: int) -> None:
        self.optimizer = _check_optimizer(type(self).__name__, optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def _start(self) -> None:
        # Called by subclasses once their fields are set, since get_lr() reads them.
        if self.last_batch_iteration == -1:
            self._apply(self.get_lr())

    def _apply(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # the same tensor: a compiled step may have captured it
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)

    @abstractmethod
    def get_lr(self) -> list[float]:
        """The learning rate of each param group at ``last_batch_iteration``."""

    def get_last_lr(self) -> list[float]:
        """The learning rates last written into the optimizer, one per param group."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): call step() first")
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to `last_batch_iteration` (default: the next step) and set the lrs for it."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        """The position in the schedule; everything else comes from the constructor."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Resume at the position `sd` saved.

        Like DeepSpeed this does not touch the optimizer: its own state dict restores the
        learning rates, and the next `step` sets them from the schedule.
        """
        self.last_batch_iteration = int(sd["last_batch_iteration"])


class WarmupLR(WarmupScheduler):
    """Warm each group's lr up from `warmup_min_lr` to `warmup_max_lr`, then hold it there.

    Args:
        optimizer: a torch optimizer (or anything exposing its ``param_groups``).
        warmup_min_lr: the lr at step 0; a float, or one per param group.
        warmup_max_lr: the lr after warm-up; a float, or one per param group; None (the
            default): each group's lr as the optimizer has it.
        warmup_num_steps: the warm-up length, at least 1 (raised to 2 if smaller, as in
            DeepSpeed).
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: the last step taken; -1 to start from scratch.
    """

    def __init__(
        self,
        optimizer: _HasParamGroups,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        name = type(self).__name__
        _check_warmup(name, warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in groups]  # DeepSpeed 0.19's default
        self.min_lrs = _per_group(name, "warmup_min_lr", warmup_min_lr, len(groups))
        self.max_lrs = _per_group(name, "warmup_max_lr", warmup_max_lr, len(groups))
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(_MIN_WARMUP_STEPS, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._start()

    def _gamma(self) -> float:
        # The interpolation factor between min and max lr at the current step.
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_factor(
                self.warmup_type,
                self.inverse_log_warm_up,
                self.last_batch_iteration,
                self.warmup_num_steps,
            )
        return 1.0

    def get_lr(self) -> list[float]:
        """``min_lr + (max_lr - min_lr) * gamma`` per group; ``min_lr`` before the first step."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then a linear decay from `warmup_max_lr` to `warmup_min_lr` at `total_num_steps`.

    Args:
        optimizer: a torch optimizer (or anything exposing its ``param_groups``).
        total_num_steps: the step at which the lr is back at `warmup_min_lr`; at least
            `warmup_num_steps`.
        warmup_max_lr: the lr after warm-up; a float, or one per param group (0.001 when not
            given, DeepSpeed's default here, not the optimizer's lr as for `WarmupLR`).
        warmup_min_lr, warmup_num_steps, warmup_type, last_batch_iteration: as for `WarmupLR`.
    """

    def __init__(
        self,
        optimizer: _HasParamGroups,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_warmup(type(self).__name__, warmup_num_steps, warmup_type)
        _check_total(type(self).__name__, total_num_steps, warmup_num_steps)
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        # max(1, ...) keeps total == warmup from dividing by zero; the lr is then 0 at once.
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(WarmupScheduler):
    """Warm up from ``warmup_min_ratio`` x lr to lr, then a half cosine to ``cos_min_ratio`` x lr.

    The lr of each group when the schedule is built is its peak; the schedule multiplies it by
    a ratio, so groups with different lrs keep their proportions.

    Args:
        optimizer: a torch optimizer (or anything exposing its ``param_groups``).
        total_num_steps: the cosine reaches its minimum at step ``total_num_steps - 1`` (DeepSpeed
            counts its steps from 1) and rises again after; at least `warmup_num_steps`.
        warmup_min_ratio: the ratio at step 0.
        warmup_num_steps: the warm-up length (raised to 2 if smaller, as in DeepSpeed).
        cos_min_ratio: the ratio at `total_num_steps`.
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: the last step taken; -1 to start from scratch.
    """

    def __init__(
        self,
        optimizer: _HasParamGroups,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        name = type(self).__name__
        _check_warmup(name, warmup_num_steps, warmup_type)
        _check_total(name, total_num_steps, warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = max(_MIN_WARMUP_STEPS, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        # The peaks, read before _start() overwrites the groups' lrs.
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        """The factor applied to every group's peak lr at ``last_batch_iteration``."""
        step = self.last_batch_iteration
        if step < 0:
            return 0.0
        if step < self.warmup_num_steps:
            factor = _warmup_factor(
                self.warmup_type, self.inverse_log_warm_up, step, self.warmup_num_steps
            )
            return self.warmup_min_ratio + factor * (1.0 - self.warmup_min_ratio)
        # DeepSpeed counts the first step after warm-up as cosine step 1, not 0.
        cos_step = step - self.warmup_num_steps + 1
        cos_steps = self.total_num_steps - self.warmup_num_steps
        if cos_steps <= 0:
            # Nothing left to decay over (DeepSpeed divides by zero here): stay at the end.
            return max(0.0, self.cos_min_ratio)
        half_cosine = (1.0 + math.cos(math.pi * cos_step / cos_steps)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half_cosine)

    def get_lr(self) -> list[float]:
        """Each group's peak lr times `get_lr_ratio`; 0 before the first step, as DeepSpeed."""
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(WarmupScheduler):
    """Raise each group's lr from `lr_range_test_min_lr`, to find where training diverges.

    Args:
        optimizer: a torch optimizer (or anything exposing its ``param_groups``).
        lr_range_test_min_lr: the lr before the first step; a float, or one per param group.
        lr_range_test_step_size: steps per unit of increase.
        lr_range_test_step_rate: the increase per unit, as a fraction of the starting lr.
        lr_range_test_staircase: raise the lr once every `lr_range_test_step_size` steps
            instead of a little at every step.
        last_batch_iteration: the last step taken; -1 to start from scratch.
    """

    def __init__(
        self,
        optimizer: _HasParamGroups,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        name = type(self).__name__
        super().__init__(optimizer, last_batch_iteration)
        groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group(name, "lr_range_test_min_lr", lr_range_test_min_lr, groups)
        self.step_size = _check_steps(
            name, "lr_range_test_step_size", lr_range_test_step_size, least=1
        )
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        self._start()

    def get_lr(self) -> list[float]:
        """``min_lr * (1 + rate * (i + 1) / size)``, the quotient floored with staircase."""
        units = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            units = math.floor(units)
        return [lr * (1.0 + self.step_rate * units) for lr in self.min_lrs]


class OneCycle(WarmupScheduler):
    """One cycle of the lr up and down (and of Adam's first beta down and up), then a decay.

    Args:
        optimizer: a torch optimizer (or anything exposing its ``param_groups``).
        cycle_min_lr: the lr at the start and end of the cycle; a float, or one per group.
        cycle_max_lr: the lr at the top of the cycle; a float, or one per group.
        decay_lr_rate: how fast the lr decays after the cycle (0: it stays at cycle_min_lr).
        cycle_first_step_size: steps going up (at least 1).
        cycle_second_step_size: steps coming down (None: as many as going up; 0: the lr drops
            back to cycle_min_lr at once).
        cycle_first_stair_count: hold the lr (and beta) flat over each of this many equal
            parts of the way up; 0 (or less): change them every step.
        cycle_second_stair_count: the same on the way down (None: `cycle_first_stair_count`).
        decay_step_size: steps per unit of decay after the cycle (0: no decay).
        cycle_momentum: move the first beta against the lr, where the optimizer has betas.
        cycle_min_mom: the first beta at the top of the cycle; a float, or one per group.
        cycle_max_mom: the first beta at the start and end of the cycle; a float, or one per
            group.
        decay_mom_rate: how fast the first beta grows after the cycle (0: it stays).
        last_batch_iteration: the last step taken; -1 to start from scratch.
    """

    def __init__(
        self,
        optimizer: _HasParamGroups,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        name = type(self).__name__
        super().__init__(optimizer, last_batch_iteration)
        groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group(name, "cycle_min_lr", cycle_min_lr, groups)
        self.max_lrs = _per_group(name, "cycle_max_lr", cycle_max_lr, groups)
        self.min_moms = _per_group(name, "cycle_min_mom", cycle_min_mom, groups)
        self.max_moms = _per_group(name, "cycle_max_mom", cycle_max_mom, groups)
        self.first_step_size = _check_steps(
            name, "cycle_first_step_size", cycle_first_step_size, least=1
        )
        down = self.first_step_size if cycle_second_step_size is None else cycle_second_step_size
        self.second_step_size = _check_steps(name, "cycle_second_step_size", down, least=0)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = _check_count(
            name, "cycle_first_stair_count", cycle_first_stair_count
        )
        second_stairs = (
            self.first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.second_stair_count = _check_count(name, "cycle_second_stair_count", second_stairs)
        self.decay_step_size = _check_steps(name, "decay_step_size", decay_step_size, least=0)
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_mom_rate = float(decay_mom_rate)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in getattr(self.optimizer, "defaults", {}):
            log.warning(
                "zengine: OneCycle: cycle_momentum is off: %s has no betas",
                type(self.optimizer).__name__,
            )
            self.cycle_momentum = False
        self._start()

    def _scale(self) -> float:
        """Where step ``i`` is in the cycle: 0 at the ends, 1 at the top."""
        done = self.last_batch_iteration + 1
        x = done / self.total_size
        x -= math.floor(x)
        up = x <= self.step_ratio
        stairs = self.first_stair_count if up else self.second_stair_count
        if stairs > 0:
            # counted from the whole steps, not from x: a float a hair under a stair's edge
            # (an uneven cycle's top, say) would floor a whole stair down
            at = done % self.total_size
            if at <= self.first_step_size:
                position = at * stairs / self.first_step_size
            else:
                position = (self.total_size - at) * stairs / self.second_step_size
            return math.floor(position) / stairs
        return x / self.step_ratio if up else (x - 1) / (self.step_ratio - 1)

    def _decay_units(self, rate: float) -> float | None:
        """``rate * k / decay_step_size`` at the k-th step past the cycle; None: no decay."""
        if self.decay_step_size == 0 or rate == 0:
            return None
        k = self.last_batch_iteration - self.total_size + 1
        return rate * k / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [
                lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)
            ]
        units = self._decay_units(self.decay_lr_rate)
        return list(self.min_lrs) if units is None else [lo / (1 + units) for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Each group's Adam betas at ``last_batch_iteration``, as DeepSpeed's: None without
        momentum cycling; before the first step its formula's value (`cycle_max_mom`), though
        the optimizer holds `cycle_min_mom` then, as DeepSpeed sets it."""
        if not self.cycle_momentum:
            return None
        return [(beta1, _ONE_CYCLE_BETA2) for beta1 in self._beta1s()]

    def _beta1s(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            pairs = zip(self.min_moms, self.max_moms, strict=True)
            return [hi - (hi - lo) * scale for lo, hi in pairs]
        units = self._decay_units(self.decay_mom_rate)
        return list(self.max_moms) if units is None else [hi * (1 + units) for hi in self.max_moms]

    def _apply(self, lrs: list[float]) -> None:
        super()._apply(lrs)
        if self.cycle_momentum:
            beta1s = self.min_moms if self.last_batch_iteration < 0 else self._beta1s()
            for group, beta1 in zip(self.optimizer.param_groups, beta1s, strict=True):
                group["betas"] = (beta1, _ONE_CYCLE_BETA2)


_SCHEDULERS: dict[str, type[WarmupScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
}


def build_scheduler(
    type_name: str, optimizer: _HasParamGroups, params: Mapping[str, Any] | None = None
) -> WarmupScheduler:
    """Build the schedule a DeepSpeed config's ``"scheduler"`` section names.

    ``{"scheduler": {"type": "WarmupDecayLR", "params": {...}}}`` becomes
    ``build_scheduler("WarmupDecayLR", optimizer, {...})``. Names are case-sensitive, as in
    DeepSpeed; `params` are the constructor's keyword arguments other than `optimizer`.

    Raises:
        ValueError: an unknown `type_name`, an unknown or missing parameter, or a bad value.
    """
    cls = _SCHEDULERS.get(type_name)
    if cls is None:
        raise ValueError(
            f"build_scheduler: unknown scheduler type {type_name!r}; "
            f"expected one of {list(_SCHEDULERS)}"
        )
    params = dict(params or {})
    signature = inspect.signature(cls.__init__)
    accepted = [name for name in signature.parameters if name not in ("self", "optimizer")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"build_scheduler: unknown parameter(s) {unknown} for {type_name}; "
            f"valid ones are {accepted}"
        )
    missing = [
        name
        for name in accepted
        if signature.parameters[name].default is inspect.Parameter.empty and name not in params
    ]
    if missing:
        raise ValueError(f"build_scheduler: {type_name} needs parameter(s) {missing}")
    return cls(optimizer, **params)
