"""The types of the optimizer's and the scheduler's ``params``, checked by key.

``optimizer.params`` and ``scheduler.params`` are keyword arguments handed on as written (to a
torch optimizer, to a schedule), so a value of the wrong type used to fail inside them, far from
the config: ``"lr": "1e-2"`` was a ``TypeError`` from Adam's ``0.0 <= lr``, as it is in
DeepSpeed 0.19.8, which hands the string on too. Here each known key is checked with the rest
of the config and named by its full path (``optimizer.params.lr: expected a number, got the
string '1e-2'``). A numeric string is not converted: DeepSpeed does not convert it, and
Transformers and Accelerate write numbers (or ``"auto"``, which they replace with numbers).
Keys not listed are left for the optimizer or the schedule to judge.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from zengine._config._errors import show

__all__ = ["param_problems"]

_Check = Callable[[object], str | None]  # None when the value is fine, else what was expected


def _is_number(value: object) -> bool:
    # bool is an int to Python, but ``"lr": true`` is a mistake, not 1.0
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_tensor_number(value: object) -> bool:
    # a Python config may hand torch a 0-d tensor lr (torch's optimizers take one)
    numel = getattr(value, "numel", None)
    return callable(numel) and type(value).__name__ == "Tensor" and numel() == 1


def _number(value: object) -> str | None:
    if _is_number(value) or _is_tensor_number(value):
        return None
    return "a number"


def _integer(value: object) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return None  # 1e3: JSON writes steps so, and a schedule counts them as well in a float
    return "an integer"


def _optional(check: _Check) -> _Check:
    def optional(value: object) -> str | None:
        expected = check(value)
        return None if value is None or expected is None else f"{expected} or null"

    return optional


def _switch(value: object) -> str | None:
    # 0 and 1 are DeepSpeed's switches as well (its own tests write them)
    return (
        None
        if isinstance(value, bool) or (type(value) is int and value in (0, 1))
        else ("true or false")
    )


def _pair(value: object) -> str | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_is_number, value)):
        return None
    return "a list of two numbers"


def _per_group(value: object) -> str | None:
    # a schedule's learning rates and momenta: one for all groups, or one per group
    if _is_number(value):
        return None
    if isinstance(value, (list, tuple)) and value and all(map(_is_number, value)):
        return None
    return "a number, or a list of numbers (one per parameter group)"


def _text(value: object) -> str | None:
    return None if isinstance(value, str) else "a string"


# torch's optimizers' keyword arguments (Adam, AdamW, SGD, Adagrad; Lion's are Adam's) and
# DeepSpeed's documented ones; torch_adam and adam_w_mode are the section model's to check
_OPTIMIZER: dict[str, _Check] = {
    "lr": _number,
    "eps": _number,
    "weight_decay": _number,
    "momentum": _number,
    "dampening": _number,
    "lr_decay": _number,
    "initial_accumulator_value": _number,
    "betas": _pair,
    "amsgrad": _switch,
    "nesterov": _switch,
    "maximize": _switch,
    "capturable": _switch,
    "differentiable": _switch,
    "decoupled_weight_decay": _switch,
    "foreach": _optional(_switch),
    "fused": _optional(_switch),
}

# the keyword arguments of DeepSpeed's schedules (zengine._optim's, which take DeepSpeed's)
_SCHEDULER: dict[str, _Check] = {
    "warmup_min_lr": _per_group,
    "warmup_max_lr": _optional(_per_group),
    "lr_range_test_min_lr": _per_group,
    "cycle_min_lr": _per_group,
    "cycle_max_lr": _per_group,
    "cycle_min_mom": _per_group,
    "cycle_max_mom": _per_group,
    "warmup_min_ratio": _number,
    "cos_min_ratio": _number,
    "lr_range_test_step_rate": _number,
    "decay_lr_rate": _number,
    "decay_mom_rate": _number,
    "warmup_num_steps": _integer,
    "total_num_steps": _integer,
    "lr_range_test_step_size": _integer,
    "cycle_first_step_size": _integer,
    "cycle_second_step_size": _optional(_integer),
    "cycle_first_stair_count": _integer,
    "cycle_second_stair_count": _optional(_integer),
    "decay_step_size": _integer,
    "last_batch_iteration": _integer,
    "lr_range_test_staircase": _switch,
    "cycle_momentum": _switch,
    "warmup_type": _text,
}

_SECTIONS = {"optimizer": _OPTIMIZER, "scheduler": _SCHEDULER}


def param_problems(config: Mapping[Any, Any]) -> list[str]:
    """One line per value of the wrong type among the ``params`` of the raw config's
    ``optimizer`` and ``scheduler`` sections, each starting with the key's full path."""
    problems: list[str] = []
    for section, checks in _SECTIONS.items():
        body = config.get(section)
        params = body.get("params") if isinstance(body, Mapping) else None
        if not isinstance(params, Mapping):
            continue  # a missing or mistyped section is the section model's to report
        for key in sorted(checks.keys() & params.keys()):
            value = params[key]
            expected = checks[key](value)
            if expected is not None:
                problems.append(f"{section}.params.{key}: expected {expected}, got {_given(value)}")
    return problems


def _given(value: object) -> str:
    if not isinstance(value, str):
        return show(value)
    if value == "auto":  # left for a training run to fill, and not filled
        return "'auto' (Transformers' Trainer and Accelerate fill it in; initialize does not)"
    try:
        number = float(value)
    except ValueError:
        return f"the string {show(value)}"
    if math.isfinite(number):
        return f"the string {show(value)} (write the number without quotes: {value.strip()})"
    return f"the string {show(value)}"
