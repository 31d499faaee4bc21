"""DeepSpeed's learning-rate flags: `add_tuning_arguments` and `scheduler_from_args`, which
turn a script's command line into the config's ``"scheduler"`` section."""

from __future__ import annotations

import argparse
import inspect

import pytest
import torch

import zengine.config
from zengine._optim import OneCycle, build_scheduler
from zengine._optim._lr_schedules import _SCHEDULERS


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    assert zengine.config.add_tuning_arguments(parser) is parser
    return parser.parse_args(list(argv))


def test_no_lr_schedule_is_no_section() -> None:
    assert zengine.config.scheduler_from_args(_parse()) is None
    assert zengine.config.scheduler_from_args(argparse.Namespace()) is None


def test_a_schedule_reads_its_own_flags_with_deepspeeds_defaults() -> None:
    args = _parse("--lr_schedule", "WarmupLR", "--warmup_num_steps", "50", "--cycle_min_lr", "1")
    assert zengine.config.scheduler_from_args(args) == {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 0.001,
            "warmup_num_steps": 50,
            "warmup_type": "log",
        },
    }
    cosine = zengine.config.scheduler_from_args(_parse("--lr_schedule", "WarmupCosineLR"))
    assert cosine is not None
    assert cosine["params"] == {
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "warmup_min_ratio": 0.01,
        "cos_min_ratio": 0.01,
    }


def test_one_cycle_from_the_flags_builds_with_its_second_half_as_long_as_the_first() -> None:
    # DeepSpeed's --cycle_second_step_size default (-1) is one its OneCycle refuses; none is
    # given here, so the schedule takes the first half's length, as the flag's help says
    section = zengine.config.scheduler_from_args(
        _parse(
            "--lr_schedule", "OneCycle", "--cycle_first_step_size", "4", "--lr_range_test_staircase"
        )
    )
    assert section is not None
    assert "cycle_second_step_size" not in section["params"]
    assert "lr_range_test_staircase" not in section["params"]  # another schedule's flag
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    schedule = build_scheduler(section["type"], optimizer, section["params"])
    assert isinstance(schedule, OneCycle)
    assert schedule.total_size == 8


def test_an_unknown_schedule_is_named() -> None:
    with pytest.raises(zengine.ConfigError, match=r"lr_schedule: 'Cosine' is not a schedule"):
        zengine.config.scheduler_from_args(_parse("--lr_schedule", "Cosine"))


@pytest.mark.parametrize("schedule", sorted(zengine.config.SCHEDULE_FLAGS))
def test_every_flag_of_a_schedule_is_a_parameter_of_it(schedule: str) -> None:
    """The flags live with the config (below the optimizer layer), so they name the schedules'
    parameters themselves: this keeps the two lists in step."""
    accepted = inspect.signature(_SCHEDULERS[schedule].__init__).parameters
    assert set(zengine.config.SCHEDULE_FLAGS[schedule]) <= set(accepted)
    assert set(zengine.config.SCHEDULE_FLAGS) == set(_SCHEDULERS)
