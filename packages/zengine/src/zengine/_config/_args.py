"""DeepSpeed's command-line flags, which training scripts add to their own parser:
``add_config_arguments`` (the config file, for ``initialize(args=...)``) and
``add_tuning_arguments`` (a learning-rate schedule, which `scheduler_from_args` turns into the
config's ``"scheduler"`` section)."""

from __future__ import annotations

import argparse
from typing import Any

from zengine._config._errors import ConfigError

__all__ = ["SCHEDULE_FLAGS", "add_config_arguments", "add_tuning_arguments", "scheduler_from_args"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed`` and ``--deepspeed_config`` (and DeepSpeed's hidden old spellings,
    ``--deepscale`` and ``--deepscale_config``) to `parser`, in a group of their own, and
    return it, as DeepSpeed's ``add_config_arguments``. ``initialize(args=parser.parse_args())``
    reads the config from ``args.deepspeed_config``."""
    group = parser.add_argument_group("DeepSpeed", "zengine's DeepSpeed-style configuration")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="train with zengine (accepted as DeepSpeed's flag; it changes nothing here)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON config file"
    )
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


# DeepSpeed's learning-rate flags: (type, default, help); a bool is a store_true switch. The
# defaults are DeepSpeed's, except --cycle_second_step_size: DeepSpeed's -1 is a value its
# OneCycle refuses, where the help promises the first step size, which None gives.
_TUNING_FLAGS: dict[str, tuple[type, object, str]] = {
    "lr_range_test_min_lr": (float, 0.001, "LRRangeTest: the starting lr"),
    "lr_range_test_step_rate": (float, 1.0, "LRRangeTest: the lr's rate of increase"),
    "lr_range_test_step_size": (int, 1000, "LRRangeTest: steps per increase"),
    "lr_range_test_staircase": (bool, False, "LRRangeTest: increase in stairs"),
    "cycle_first_step_size": (int, 1000, "OneCycle: steps of the first half"),
    "cycle_first_stair_count": (int, -1, "OneCycle: stairs of the first half (<= 0: none)"),
    "cycle_second_step_size": (int, None, "OneCycle: steps of the second half (default: first)"),
    "cycle_second_stair_count": (int, -1, "OneCycle: stairs of the second half (<= 0: none)"),
    "decay_step_size": (int, 1000, "OneCycle: steps per unit of decay after the cycle"),
    "cycle_min_lr": (float, 0.01, "OneCycle: the lowest lr"),
    "cycle_max_lr": (float, 0.1, "OneCycle: the highest lr"),
    "decay_lr_rate": (float, 0.0, "OneCycle: the lr's decay rate after the cycle"),
    "cycle_momentum": (bool, False, "OneCycle: cycle the momentum (not read, as in DeepSpeed)"),
    "cycle_min_mom": (float, 0.8, "OneCycle: the lowest momentum"),
    "cycle_max_mom": (float, 0.9, "OneCycle: the highest momentum"),
    "decay_mom_rate": (float, 0.0, "OneCycle: the momentum's decay rate after the cycle"),
    "warmup_min_lr": (float, 0.0, "WarmupLR: the starting lr"),
    "warmup_max_lr": (float, 0.001, "WarmupLR: the lr after warm-up"),
    "warmup_num_steps": (int, 1000, "WarmupLR: steps of warm-up"),
    "warmup_type": (str, "log", "WarmupLR: the warm-up curve, log or linear"),
    "warmup_min_ratio": (float, 0.01, "WarmupCosineLR: the starting ratio of the lr"),
    "cos_min_ratio": (float, 0.01, "WarmupCosineLR: the final ratio of the lr"),
}

# The flags each schedule reads, DeepSpeed's choice (WarmupDecayLR reads WarmupLR's: its
# total_num_steps has no flag, so the config must add it).
_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type")
SCHEDULE_FLAGS: dict[str, tuple[str, ...]] = {
    "LRRangeTest": tuple(name for name in _TUNING_FLAGS if name.startswith("lr_range_test_")),
    "OneCycle": tuple(
        name
        for name in _TUNING_FLAGS
        if name.startswith(("cycle_", "decay_")) and name != "cycle_momentum"
    ),
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": _WARMUP,
    "WarmupCosineLR": ("warmup_num_steps", "warmup_type", "warmup_min_ratio", "cos_min_ratio"),
}


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's learning-rate flags (``--lr_schedule`` and each schedule's parameters,
    ``--warmup_num_steps`` and so on) to `parser`, in a group of their own, and return it, as
    DeepSpeed's ``lr_schedules.add_tuning_arguments``; `scheduler_from_args` reads them back."""
    group = parser.add_argument_group("Convergence Tuning", "the learning-rate schedule")
    group.add_argument(
        "--lr_schedule", type=str, default=None, help=f"one of {', '.join(SCHEDULE_FLAGS)}"
    )
    for name, (kind, default, text) in _TUNING_FLAGS.items():
        if kind is bool:
            group.add_argument(f"--{name}", default=default, action="store_true", help=text)
        else:
            group.add_argument(f"--{name}", type=kind, default=default, help=text)
    return parser


def scheduler_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The config's ``"scheduler"`` section that `add_tuning_arguments`' flags give: ``{"type":
    args.lr_schedule, "params": {...}}`` with the flags that schedule reads (those `args` has and
    are not None). None when `args` names no ``lr_schedule``.

    Raises:
        ConfigError: an ``lr_schedule`` that is none of DeepSpeed's schedules.
    """
    schedule = getattr(args, "lr_schedule", None)
    if schedule is None:
        return None
    flags = SCHEDULE_FLAGS.get(schedule)
    if flags is None:
        raise ConfigError(
            [f"lr_schedule: {schedule!r} is not a schedule; expected one of {list(SCHEDULE_FLAGS)}"]
        )
    given = {name: getattr(args, name, None) for name in flags}
    return {"type": schedule, "params": {k: v for k, v in given.items() if v is not None}}
