"""``deepspeed.runtime.lr_schedules``: zengine's schedules, DeepSpeed's names of the schedules and
of their parameters (the keys of a config's ``"scheduler"`` section), and its command-line flags
(`add_tuning_arguments`, read back by `get_config_from_args`). Accelerate tells a DeepSpeed
scheduler by ``type(obj).__name__ in VALID_LR_SCHEDULES``."""

from __future__ import annotations

import argparse
from typing import Any

import zengine.config
from zengine import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "COS_MIN_RATIO",
    "CYCLE_FIRST_STAIR_COUNT",
    "CYCLE_FIRST_STEP_SIZE",
    "CYCLE_MAX_LR",
    "CYCLE_MAX_MOM",
    "CYCLE_MIN_LR",
    "CYCLE_MIN_MOM",
    "CYCLE_SECOND_STAIR_COUNT",
    "CYCLE_SECOND_STEP_SIZE",
    "DECAY_LR_RATE",
    "DECAY_MOM_RATE",
    "DECAY_STEP_SIZE",
    "LR_RANGE_TEST",
    "LR_RANGE_TEST_MIN_LR",
    "LR_RANGE_TEST_STAIRCASE",
    "LR_RANGE_TEST_STEP_RATE",
    "LR_RANGE_TEST_STEP_SIZE",
    "LR_SCHEDULE",
    "ONE_CYCLE",
    "TOTAL_NUM_STEPS",
    "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LINEAR_RATE",
    "WARMUP_LOG_RATE",
    "WARMUP_LR",
    "WARMUP_MAX_LR",
    "WARMUP_MIN_LR",
    "WARMUP_MIN_RATIO",
    "WARMUP_NUM_STEPS",
    "WARMUP_TYPE",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "add_tuning_arguments",
    "get_config_from_args",
]

# the schedules' names: a config's "scheduler": {"type": ...}
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = LRRangeTest.__name__
ONE_CYCLE = OneCycle.__name__
WARMUP_LR = WarmupLR.__name__
WARMUP_DECAY_LR = WarmupDecayLR.__name__
WARMUP_COSINE_LR = WarmupCosineLR.__name__
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

# their parameters: the keys of "scheduler": {"params": {...}}, zengine's argument names
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

add_tuning_arguments = zengine.config.add_tuning_arguments


def get_config_from_args(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """DeepSpeed's ``(scheduler section, None)`` from `add_tuning_arguments`' flags, or
    ``(None, why not)`` when ``--lr_schedule`` is missing or names no schedule (zengine's
    `scheduler_from_args`, in DeepSpeed's return convention)."""
    try:
        section = zengine.config.scheduler_from_args(args)
    except zengine.ConfigError as error:
        return None, str(error)
    if section is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    return section, None
