"""``deepspeed.runtime.config.DeepSpeedConfig`` and ``runtime.precision_config``: DeepSpeed's
config reader over zengine's, read under DeepSpeed's attribute names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import deepspeed
import zengine
from deepspeed.runtime.config import ADAM_OPTIMIZER, DeepSpeedConfig
from deepspeed.runtime.precision_config import (
    DeepSpeedBF16Config,
    DeepSpeedFP16Config,
    get_bfloat16_config,
    get_float16_config,
)
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from unit.common import DistributedTest

CONFIG: dict[str, Any] = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 7,
    "gradient_clipping": 1.5,
    "gradient_allreduce_op": "SUM",
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
    "bfloat16": {"enabled": True},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e5},
    "checkpoint": {"tag_validation": "fail"},
    "communication_data_type": "fp32",
}


def _sizes(config: DeepSpeedConfig) -> tuple[int | None, int | None, int | None]:
    return (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    )


class TestBatchSizes(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_resolved_against_the_world_and_again_after_changes(self, world_size: int) -> None:
        config = DeepSpeedConfig(CONFIG)
        assert config.world_size == dist.get_world_size() == world_size
        assert config.global_rank == dist.get_rank()
        micro = 16 // 2 // world_size
        assert _sizes(config) == (16, micro, 2)
        # DeepSpeed's protocol: change some, set the others to None, derive them again
        config.train_batch_size, config.gradient_accumulation_steps = None, None
        config.train_micro_batch_size_per_gpu = 2
        config._configure_train_batch_size()
        assert _sizes(config) == (2 * world_size, 2, 1)
        config.train_batch_size, config.train_micro_batch_size_per_gpu = 4 * world_size + 1, 4
        with pytest.raises(AssertionError, match=r"train_batch_size \d+ != train_micro_batch"):
            config._configure_train_batch_size()
        config.train_batch_size = config.train_micro_batch_size_per_gpu = None
        with pytest.raises(AssertionError, match="train_batch_size: not given"):
            config._configure_train_batch_size()


def test_the_data_parallel_size_of_a_model_parallel_unit() -> None:
    class MPU:
        def get_data_parallel_world_size(self) -> int:
            return 4

    config = DeepSpeedConfig(CONFIG, mpu=MPU())
    assert (config.world_size, config.train_micro_batch_size_per_gpu) == (4, 2)


def test_deepspeeds_attribute_names_read_zengines_config(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    config = DeepSpeedConfig(str(path))
    assert config._param_dict == CONFIG  # the config as given
    engine_config = zengine.load_config(CONFIG, world_size=1)
    assert config.zero_config == engine_config.zero_optimization
    assert isinstance(config.zero_config, DeepSpeedZeroConfig)
    assert (config.zero_optimization_stage, config.zero_enabled) == (2, True)
    assert config.zero_config.reduce_bucket_size == 500_000
    assert config.bfloat16_config.enabled
    assert not config.float16_config.enabled
    assert (config.steps_per_print, config.gradient_clipping) == (7, 1.5)
    assert config.gradient_allreduce_op == "sum"  # DeepSpeed lowercases it
    assert (config.prescale_gradients, config.gradient_predivide_factor) == (False, 1.0)
    assert config.communication_data_type is torch.float32
    assert config.optimizer_name == "adamw"  # DeepSpeed's lower case
    assert config.optimizer_params == {"lr": 1e-3}
    assert (config.scheduler_name, config.scheduler_params) == ("WarmupLR", {"warmup_num_steps": 3})
    assert config.checkpoint_tag_validation_enabled
    assert config.checkpoint_tag_validation_fail
    assert not config.load_universal_checkpoint
    assert config.grad_accum_dtype is None
    assert (config.torch_autocast_enabled, config.torch_autocast_dtype) == (False, None)
    assert (config.wall_clock_breakdown, config.dataloader_drop_last) == (False, False)
    assert not config.zero_allow_untested_optimizer
    assert config.zero_force_ds_cpu_optimizer
    bare = DeepSpeedConfig({"train_batch_size": 1, "optimizer": {"type": ADAM_OPTIMIZER}})
    assert (bare.optimizer_name, bare.scheduler_name, bare.scheduler_params) == ("adam", None, None)
    assert not bare.checkpoint_tag_validation_fail


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"gradient_allreduce_op": "max"}, "Invalid gradient_allreduce_op 'max'"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: must be 0, 1, 2 or 3"),
        ({"zero_optimization": {"stage": 2, "zenflow": {}}}, "zero_optimization.zenflow: "),
        ({"train_batch_size": 3, "gradient_accumulation_steps": 2}, "cannot be derived"),
    ],
)
def test_a_bad_config_names_the_key(change: dict[str, Any], problem: str) -> None:
    with pytest.raises(deepspeed.DeepSpeedConfigError, match=problem) as raised:
        DeepSpeedConfig({**CONFIG, **change})
    assert isinstance(raised.value, ValueError)  # DeepSpeed's config errors are


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="config file not found"):
        DeepSpeedConfig(str(tmp_path / "nothing.json"))


def test_the_precision_sections_on_their_own() -> None:
    """``get_bfloat16_config`` reads the section (under either name) without the batch sizes."""
    for key in ("bf16", "bfloat16"):
        bf16 = get_bfloat16_config({key: {"enabled": True}})
        assert isinstance(bf16, DeepSpeedBF16Config)
        assert bf16.enabled
    assert get_bfloat16_config({}) == DeepSpeedBF16Config()
    fp16 = get_float16_config({"fp16": {"enabled": True, "loss_scale": 128}})
    assert isinstance(fp16, DeepSpeedFP16Config)
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power) == (True, 128.0, 16)
    with pytest.raises(deepspeed.DeepSpeedConfigError, match=r"fp16\.loss_scale: must be >= 0"):
        get_float16_config({"fp16": {"loss_scale": -1}})


@pytest.mark.parametrize(
    "key", ["stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"]
)
def test_the_zero_section_under_deepspeeds_attribute_names(key: str) -> None:
    keys: dict[str, Any] = {key: True, "stage3_max_live_parameters": 10}
    zero = DeepSpeedZeroConfig(**keys)
    assert zero.gather_16bit_weights_on_model_save is True
    assert zero.max_live_parameters == zero.stage3_max_live_parameters == 10
