"""``deepspeed.runtime.lr_schedules``: DeepSpeed's names of the schedules and their parameters
are zengine's, and its command-line flags give a config section that builds."""

from __future__ import annotations

import argparse
import inspect

import pytest
import torch

import deepspeed
import zengine
from deepspeed.runtime import lr_schedules as lrs
from unit.common import DistributedTest
from unit.simple_model import SimpleModel


def test_the_schedule_names_are_zengines_classes() -> None:
    assert lrs.VALID_LR_SCHEDULES == [
        "LRRangeTest",
        "OneCycle",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
    ]
    for name in lrs.VALID_LR_SCHEDULES:
        assert getattr(lrs, name) is getattr(zengine, name)  # Accelerate looks them up so
    assert (lrs.WARMUP_LR, lrs.ONE_CYCLE, lrs.LR_RANGE_TEST) == (
        "WarmupLR",
        "OneCycle",
        "LRRangeTest",
    )


@pytest.mark.parametrize(
    ("schedule", "constants"),
    [
        (
            "LRRangeTest",
            [
                "LR_RANGE_TEST_MIN_LR",
                "LR_RANGE_TEST_STEP_RATE",
                "LR_RANGE_TEST_STEP_SIZE",
                "LR_RANGE_TEST_STAIRCASE",
            ],
        ),
        (
            "OneCycle",
            [
                "CYCLE_FIRST_STEP_SIZE",
                "CYCLE_FIRST_STAIR_COUNT",
                "CYCLE_SECOND_STEP_SIZE",
                "CYCLE_SECOND_STAIR_COUNT",
                "DECAY_STEP_SIZE",
                "CYCLE_MIN_LR",
                "CYCLE_MAX_LR",
                "DECAY_LR_RATE",
                "CYCLE_MIN_MOM",
                "CYCLE_MAX_MOM",
                "DECAY_MOM_RATE",
            ],
        ),
        (
            "WarmupDecayLR",
            [
                "WARMUP_MIN_LR",
                "WARMUP_MAX_LR",
                "WARMUP_NUM_STEPS",
                "WARMUP_TYPE",
                "TOTAL_NUM_STEPS",
            ],
        ),
        ("WarmupCosineLR", ["WARMUP_MIN_RATIO", "COS_MIN_RATIO", "TOTAL_NUM_STEPS"]),
    ],
)
def test_the_parameter_names_are_the_schedules_arguments(
    schedule: str, constants: list[str]
) -> None:
    """A config's ``"params"`` written with DeepSpeed's constants reach zengine's schedules."""
    accepted = inspect.signature(getattr(lrs, schedule).__init__).parameters
    for constant in constants:
        assert getattr(lrs, constant) in accepted, constant
    assert {lrs.WARMUP_LOG_RATE, lrs.WARMUP_LINEAR_RATE} == {"log", "linear"}


def test_the_command_line_gives_a_scheduler_section() -> None:
    parser = lrs.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lr_schedule", lrs.ONE_CYCLE, "--cycle_max_lr", "0.5"])
    config, error = lrs.get_config_from_args(args)
    assert error is None
    assert config is not None
    assert config["type"] == "OneCycle"
    assert config["params"][lrs.CYCLE_MAX_LR] == 0.5
    assert lrs.get_config_from_args(parser.parse_args([])) == (
        None,
        "--lr_schedule not specified on command line",
    )
    config, error = lrs.get_config_from_args(parser.parse_args(["--lr_schedule", "Linear"]))
    assert config is None
    assert error is not None
    assert "lr_schedule: 'Linear' is not a schedule" in error


class TestFromTheConfig(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_a_config_written_with_the_constants_builds_the_schedule(self, world_size: int) -> None:
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "scheduler": {
                "type": lrs.WARMUP_LR,
                "params": {lrs.WARMUP_NUM_STEPS: 4, lrs.WARMUP_TYPE: lrs.WARMUP_LINEAR_RATE},
            },
        }
        model = SimpleModel(4)
        engine, _, _, schedule = deepspeed.initialize(model=model, config=config)
        assert isinstance(schedule, lrs.WarmupLR)
        assert schedule.max_lrs == [0.01]  # no warmup_max_lr: the optimizer's, DeepSpeed 0.19's
        for step in range(5):
            x = torch.randn(1, 4)
            engine.backward(engine(x, torch.zeros(1, dtype=torch.long)))
            engine.step()
            assert schedule.get_lr() == pytest.approx([0.01 * min(step / 4, 1.0)])
