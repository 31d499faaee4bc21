"""load_config: DeepSpeed's keys and defaults, batch-size resolution, and the error messages."""

from __future__ import annotations

import enum
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from zengine._config import (
    BF16Config,
    ConfigError,
    EngineConfig,
    ZeroConfig,
    load_config,
    read_section,
    resolve_batch_sizes,
)
from zpartition import ZeroParamConfig

# The config of DeepSpeed's test_zero_context_return.py (seeds/000_339ec31897b12b43.txt).
SEED_CONFIG: dict[str, Any] = {
    "train_batch_size": 1,
    "steps_per_print": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1},
    "fp16": {"enabled": True, "loss_scale": 138.0},
}


def _problems(config: Any, world_size: int = 1) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=world_size)
    assert str(info.value) == "\n".join(info.value.problems)
    return list(info.value.problems)


def _zero(**keys: Any) -> dict[str, Any]:
    return {"train_batch_size": 4, "zero_optimization": keys}


# --- defaults ---------------------------------------------------------------------------


def test_top_level_defaults() -> None:
    config = load_config({"train_batch_size": 8}, world_size=2)
    assert isinstance(config, EngineConfig)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (8, 4)
    assert config.gradient_accumulation_steps == 1
    assert config.steps_per_print == 10
    assert config.gradient_clipping == 0.0
    assert config.optimizer is None
    assert config.scheduler is None
    assert config.wall_clock_breakdown is False
    assert config.gradient_accumulation_dtype is None
    assert config.data_types.grad_accum_dtype is None
    assert config.communication_data_type is None
    assert config.dataloader_drop_last is False
    assert config.zero_allow_untested_optimizer is False
    assert config.zero_stage == 0
    assert (config.fp16_enabled, config.bf16_enabled) == (False, False)
    assert config.dtype == torch.float32


def test_fp16_bf16_checkpoint_defaults() -> None:
    config = load_config({"train_batch_size": 1}, world_size=1)
    fp16 = config.fp16
    assert fp16.enabled is False
    assert fp16.auto_cast is False
    assert fp16.loss_scale == 0.0
    assert fp16.dynamic_loss_scale is True
    assert fp16.initial_scale_power == 16
    assert fp16.initial_dynamic_scale == 65536.0
    assert fp16.loss_scale_window == 1000
    assert fp16.hysteresis == 2
    assert fp16.consecutive_hysteresis is False
    assert fp16.min_loss_scale == 1.0
    assert config.bf16.enabled is False
    checkpoint = config.checkpoint
    assert checkpoint.tag_validation == "WARN"
    assert checkpoint.load_universal is False
    assert checkpoint.use_node_local_storage is False
    assert checkpoint.parallel_write.pipeline_stage is False


def test_zero_defaults() -> None:
    zero = load_config({"train_batch_size": 1}, world_size=1).zero_optimization
    assert zero.stage == 0
    assert zero.overlap_comm is False
    assert zero.contiguous_gradients is True
    assert zero.reduce_scatter is True
    assert zero.reduce_bucket_size == 500_000_000
    assert zero.allgather_bucket_size == 500_000_000
    assert zero.allgather_partitions is True
    assert zero.round_robin_gradients is False
    assert zero.ignore_unused_parameters is True
    assert zero.load_from_fp32_weights is True
    assert zero.sub_group_size == 1_000_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_model_persistence_threshold == sys.maxsize
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.stage3_max_reuse_distance == 1_000_000_000
    assert zero.stage3_module_granularity_threshold == 0
    assert zero.stage3_gather_16bit_weights_on_model_save is False


def test_offload_defaults() -> None:
    zero = load_config({"train_batch_size": 1}, world_size=1).zero_optimization
    param, optimizer = zero.offload_param, zero.offload_optimizer
    assert (param.device, param.nvme_path, param.pin_memory) == ("none", None, False)
    assert (param.buffer_count, param.buffer_size, param.max_in_cpu) == (5, 100_000_000, 10**9)
    assert (optimizer.device, optimizer.nvme_path, optimizer.pin_memory) == ("none", None, False)
    assert (optimizer.buffer_count, optimizer.fast_init) == (4, False)
    assert (optimizer.pipeline_read, optimizer.pipeline_write) == (False, False)


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"stage": 0}, False),
        ({"stage": 1}, False),
        ({"stage": 2}, False),
        ({"stage": 3}, True),
        ({"stage": 3, "overlap_comm": False}, False),
        ({"stage": 2, "overlap_comm": True}, True),
        ({"stage": 3, "overlap_comm": None}, True),
    ],
)
def test_overlap_comm_defaults_to_stage_3(keys: dict[str, Any], expected: bool) -> None:
    assert load_config(_zero(**keys), world_size=1).zero_optimization.overlap_comm is expected


def test_zero_param_config_defaults_match_zpartition() -> None:
    stage3 = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    assert load_config(stage3, world_size=1).zero_param_config() == ZeroParamConfig()
    off = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "overlap_comm": False}}
    assert not load_config(off, world_size=1).zero_param_config().overlap_comm


# --- values -----------------------------------------------------------------------------


def test_seed_config_loads() -> None:
    config = load_config(SEED_CONFIG, world_size=1)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (1, 1)
    assert config.gradient_accumulation_steps == 1
    assert config.steps_per_print == 1
    assert config.optimizer is not None
    assert (config.optimizer.type, config.optimizer.params) == ("Adam", {"lr": 0.00015})
    assert config.zero_stage == 3
    assert config.zero_optimization.overlap_comm is True
    assert config.zero_param_config().param_persistence_threshold == 1
    assert config.fp16_enabled is True
    assert config.fp16.loss_scale == 138.0
    assert config.fp16.dynamic_loss_scale is False
    assert config.dtype == torch.float16


def test_steps_per_print_inf_means_never() -> None:
    """Accelerate sets ``steps_per_print: inf`` to keep DeepSpeed quiet; DeepSpeed takes it."""
    config = load_config({"train_batch_size": 1, "steps_per_print": float("inf")}, world_size=1)
    assert config.steps_per_print == float("inf")


def test_seed_config_with_bf16_loads() -> None:
    config = {**SEED_CONFIG, "bf16": {"enabled": True}}
    del config["fp16"]
    assert load_config(config, world_size=1).dtype == torch.bfloat16


def test_zero_param_config_maps_stage3_keys() -> None:
    config = load_config(
        _zero(
            stage=3,
            stage3_prefetch_bucket_size=11,
            stage3_param_persistence_threshold=12,
            stage3_model_persistence_threshold=13,
            stage3_max_live_parameters=14,
            stage3_max_reuse_distance=15,
            stage3_module_granularity_threshold=16,
            reduce_bucket_size=17,
            module_group_size=18,
        ),
        world_size=1,
    )
    assert config.zero_param_config() == ZeroParamConfig(
        prefetch_bucket_size=11,
        param_persistence_threshold=12,
        model_persistence_threshold=13,
        max_live_parameters=14,
        max_reuse_distance=15,
        module_granularity_threshold=16,
        reduce_bucket_size=17,
        module_group_size=18,
    )


def test_sizes_written_as_floats_become_ints() -> None:
    zero = load_config(
        _zero(reduce_bucket_size=5e8, stage3_prefetch_bucket_size=2e7, sub_group_size=1e9),
        world_size=1,
    ).zero_optimization
    assert zero.reduce_bucket_size == 500_000_000
    assert type(zero.reduce_bucket_size) is int
    assert type(zero.stage3_prefetch_bucket_size) is int
    assert zero.stage3_prefetch_bucket_size == 20_000_000
    assert zero.sub_group_size == 1_000_000_000


@pytest.mark.parametrize(
    ("written", "canonical"), [("adam", "Adam"), ("ADAMW", "AdamW"), ("sgd", "SGD")]
)
def test_optimizer_type_is_case_insensitive(written: str, canonical: str) -> None:
    config = load_config({"train_batch_size": 1, "optimizer": {"type": written}}, world_size=1)
    assert config.optimizer is not None
    assert config.optimizer.type == canonical
    assert config.optimizer.params == {}


def test_optimizer_params_are_kept_as_given() -> None:
    params = {"lr": 1e-3, "betas": [0.9, 0.95], "torch_adam": True, "adam_w_mode": False}
    config = load_config(
        {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": params}}, world_size=1
    )
    assert config.optimizer is not None
    assert config.optimizer.params == params


def test_switches_take_zero_and_one_as_deepspeed_does() -> None:
    params = {"lr": 1e-3, "torch_adam": 1}
    written = {
        "train_batch_size": 1,
        "zero_allow_untested_optimizer": 1,
        "wall_clock_breakdown": 0,
        "optimizer": {"type": "Adam", "params": params},
        "bf16": {"enabled": 1},
        "zero_optimization": {"stage": 2, "overlap_comm": 0, "cpu_offload": 1},
    }
    config = load_config(written, world_size=1)
    assert config.zero_allow_untested_optimizer is True
    assert config.wall_clock_breakdown is False
    assert config.bf16.enabled is True
    assert config.zero_optimization.overlap_comm is False
    assert config.zero_optimization.offload_optimizer.device == "cpu"  # the old switch, on
    assert config.optimizer is not None
    assert config.optimizer.params["torch_adam"] is True
    assert params["torch_adam"] == 1  # the caller's dict is left as written


def test_deepspeed_optimizer_options_are_bools() -> None:
    params = {"lr": 1e-3, "torch_adam": 1, "adam_w_mode": "no"}
    assert _problems({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": params}}) == [
        "optimizer.params.adam_w_mode: expected true or false, got 'no'"
    ]


def test_scheduler_and_tag_validation_are_canonical() -> None:
    config = load_config(
        {
            "train_batch_size": 1,
            "scheduler": {"type": "warmuplr", "params": {"warmup_num_steps": 10}},
            "checkpoint": {"tag_validation": "Fail", "load_universal": True},
        },
        world_size=1,
    )
    assert config.scheduler is not None
    assert (config.scheduler.type, config.scheduler.params) == (
        "WarmupLR",
        {"warmup_num_steps": 10},
    )
    assert config.checkpoint.tag_validation == "FAIL"
    assert config.checkpoint.load_universal is True


def test_bfloat16_alias_and_older_gather_key() -> None:
    config = load_config(
        {
            "train_batch_size": 1,
            "bfloat16": {"enabled": True},
            "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True},
        },
        world_size=1,
    )
    assert config.bf16_enabled is True
    assert config.zero_optimization.stage3_gather_16bit_weights_on_model_save is True


class _Device(str, enum.Enum):  # like zoffload.OffloadDeviceEnum
    cpu = "cpu"
    nvme = "nvme"


def test_offload_sections() -> None:
    config = load_config(
        _zero(
            stage=3,
            offload_param={"device": "nvme", "nvme_path": "/local_nvme", "buffer_size": 1e8},
            offload_optimizer={"device": _Device.cpu, "pin_memory": True},
        ),
        world_size=1,
    )
    zero = config.zero_optimization
    assert zero.offload_param.device == "nvme"
    assert zero.offload_param.nvme_path == Path("/local_nvme")
    assert zero.offload_optimizer.device == "cpu"
    assert type(zero.offload_optimizer.device) is str
    assert zero.offload_optimizer.pin_memory is True


def test_aio_section() -> None:
    # absent: zoffload's own defaults; present: DeepSpeed's for what it leaves out
    assert load_config({"train_batch_size": 1}, world_size=1).aio is None
    aio = load_config({"train_batch_size": 1, "aio": {}}, world_size=1).aio
    assert aio is not None
    assert (aio.block_size, aio.queue_depth, aio.thread_count) == (1_048_576, 8, 1)
    assert (aio.requests_in_flight, aio.chunk_bytes) == (8, 1_048_576)
    written = {  # as the Hugging Face docs write it for ZeRO-Infinity
        "block_size": 262144,
        "queue_depth": 32,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    }
    aio = load_config({"train_batch_size": 1, "aio": written}, world_size=1).aio
    assert aio is not None
    assert (aio.requests_in_flight, aio.chunk_bytes) == (32, 262144)
    newer = {"block_size": 5000, "intra_op_parallelism": 2, "use_gds": False}
    aio = load_config({"train_batch_size": 1, "aio": newer}, world_size=1).aio
    assert aio is not None
    assert (aio.thread_count, aio.requests_in_flight, aio.chunk_bytes) == (2, 16, 8192)


def test_bad_aio_values_are_named() -> None:
    problems = _problems({"train_batch_size": 1, "aio": {"block_size": 0, "queue_dept": 4}})
    assert problems[0].startswith("aio.block_size: ")
    assert problems[1] == "aio.queue_dept: unknown key; did you mean 'queue_depth'?"


def test_null_offload_means_none() -> None:
    zero = load_config(_zero(offload_param=None), world_size=1).zero_optimization
    assert zero.offload_param.device == "none"


def test_optional_top_level_keys() -> None:
    config = load_config(
        {
            "train_batch_size": 1,
            "gradient_clipping": 1,
            "wall_clock_breakdown": True,
            "data_types": {"grad_accum_dtype": "fp32"},
            "zero_optimization": {"stage": 3},
            "bf16": {"enabled": True},
            "communication_data_type": "bf16",  # the compute dtype: nothing to do
            "dataloader_drop_last": True,
            "zero_allow_untested_optimizer": True,
        },
        world_size=1,
    )
    assert config.gradient_clipping == 1.0
    assert config.wall_clock_breakdown is True
    assert config.gradient_accumulation_dtype == "fp32"
    assert config.communication_data_type == "bf16"
    assert config.dataloader_drop_last is True
    assert config.zero_allow_untested_optimizer is True


def test_config_is_frozen_and_input_untouched() -> None:
    given = json.loads(json.dumps(SEED_CONFIG))
    config = load_config(given, world_size=1)
    assert given == SEED_CONFIG
    with pytest.raises(pydantic.ValidationError):
        config.train_batch_size = 2
    with pytest.raises(pydantic.ValidationError):
        config.zero_optimization.stage = 1


def test_none_is_an_empty_config() -> None:
    assert _problems(None) == _problems({})


# --- JSON files -------------------------------------------------------------------------


@pytest.mark.parametrize("as_str", [True, False])
def test_json_path(tmp_path: Path, as_str: bool) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(SEED_CONFIG))
    config = load_config(str(path) if as_str else path, world_size=1)
    assert config == load_config(SEED_CONFIG, world_size=1)
    assert config.zero_param_config().param_persistence_threshold == 1


def test_deepspeed_name_of_the_error() -> None:
    import zengine

    with pytest.raises(zengine.DeepSpeedConfigError):  # what DeepSpeed users catch
        load_config({"train_batch_sise": 1}, world_size=1)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    assert _problems(path) == [f"{path}: config file not found"]


def test_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 1,\n "fp16": {"enabled": true},,}')
    assert _problems(path) == [
        f"{path}: not valid JSON (or HJSON): Found ',' where a key name was expected (check "
        "your syntax or use quotes if the key name includes {}[],: or whitespace) at line 2 "
        "column 28"
    ]


def test_hjson_as_deepspeed_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        "{\n  // DeepSpeed reads its config files as HJSON\n  train_batch_size: 8\n"
        '  fp16: {enabled: true, "loss_scale": 0}  # comments of either kind\n}\n'
    )
    config = load_config(path, world_size=2)
    assert (config.train_batch_size, config.fp16.enabled) == (8, True)
    path.write_text("{train_batch_size: 1\ntrain_batch_size: 2}")
    assert _problems(path) == [f"{path}: key 'train_batch_size' is given twice"]


def test_duplicate_json_key(tmp_path: Path) -> None:
    path = tmp_path / "twice.json"
    path.write_text('{"train_batch_size": 1, "train_batch_size": 2}')
    assert _problems(path) == [f"{path}: key 'train_batch_size' is given twice"]


def test_json_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert _problems(path) == [f"{path}: expected a JSON object, got list"]


def test_json_problems_name_keys(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 1, "zero_optimization": {"stage": 5}}')
    assert _problems(path) == ["zero_optimization.stage: must be 0, 1, 2 or 3, got 5"]


def test_config_of_the_wrong_type() -> None:
    assert _problems(3) == ["config: expected a dict or the path of a JSON file, got int"]


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0])
def test_bad_world_size(world_size: Any) -> None:
    with pytest.raises(ValueError, match=r"load_config\(world_size=...\): expected a positive"):
        load_config({"train_batch_size": 1}, world_size=world_size)


# --- errors -----------------------------------------------------------------------------


def test_unknown_nested_key_suggests_the_closest() -> None:
    assert _problems(_zero(stage3_prefetch_bucket_sise=5e7)) == [
        "zero_optimization.stage3_prefetch_bucket_sise: unknown key; "
        "did you mean 'stage3_prefetch_bucket_size'?"
    ]


def test_unknown_keys_at_every_level() -> None:
    assert _problems(
        {
            "train_batch_sise": 1,
            "fp16": {"enable": True},
            "zero_optimization": {"offload_param": {"devise": "cpu"}},
            "checkpoint": {"parallel_write": {"pipeline": True}},
        }
    ) == [
        "fp16.enable: unknown key; did you mean 'enabled'?",
        "zero_optimization.offload_param.devise: unknown key; did you mean 'device'?",
        "checkpoint.parallel_write.pipeline: unknown key; did you mean 'pipeline_stage'?",
        "train_batch_sise: unknown key; did you mean 'train_batch_size'?",
        # the misspelt key leaves no batch size given
        "train_batch_size: not given, and neither is train_micro_batch_size_per_gpu; give at "
        "least one of them (train_batch_size = train_micro_batch_size_per_gpu * "
        "gradient_accumulation_steps * world size)",
    ]


def test_unknown_key_without_a_close_match_lists_the_valid_ones() -> None:
    assert _problems({"train_batch_size": 1, "bf16": {"zzz": 1}}) == [
        "bf16.zzz: unknown key (valid keys: check_grad_overflow, enabled)"
    ]


# --- DeepSpeed keys of features zengine does not have ([Note: DeepSpeed keys without a
# feature] in zengine/_config/_deepspeed_keys.py)

# A DeepSpeed config as they are written, with every such feature off or at its default.
FEATURES_OFF: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "fp16": {"enabled": True, "auto_cast": False, "fp16_master_weights_and_grads": False},
    "bf16": {
        "enabled": False,
        "immediate_grad_update": False,
        "bf16_master_weights_and_grads": False,
        "bf16_optimizer_states": 0,
    },
    "torch_autocast": {"enabled": False, "dtype": "bfloat16"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 1.0},
        "memory_efficient_linear": True,
        "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False,
        "zero_quantized_nontrainable_weights": False,
        "zero_quantized_gradients": False,
        "mics_shard_size": -1,
        "mics_hierarchical_params_gather": False,
        "log_trace_cache_warnings": False,
        "use_all_reduce_for_fetch_params": False,
        "elastic_checkpoint": False,
        "legacy_stage1": False,
        "cpu_offload": False,
        "pipeline_loading_checkpoint": False,
    },
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "fp32_allreduce": False,
    "disable_allgather": False,
    "sparse_gradients": False,
    "zero_force_ds_cpu_optimizer": True,
    "activation_checkpointing": {"partition_activations": False, "number_checkpoints": None},
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1},
    "tensorboard": {"enabled": False, "output_path": "", "job_name": "run"},
    "wandb": {"enabled": False},
    "csv_monitor": {"enabled": False},
    "comms_logger": {"enabled": False, "verbose": False},
    "memory_breakdown": False,
    "dump_state": False,
    "amp": {"enabled": False},
    "compression_training": {},
    "data_efficiency": {"enabled": False},
    "elasticity": {"enabled": False},
    "hybrid_engine": {"enabled": False, "max_out_tokens": 512},
    "autotuning": {"enabled": False},
    "local_rank": 0,  # DeepSpeed's examples write the launcher's rank in
}


def test_a_deepspeed_config_with_those_features_off_loads_silently(
    caplog: pytest.LogCaptureFixture,
) -> None:
    given = json.loads(json.dumps(FEATURES_OFF))
    with caplog.at_level("WARNING", logger="zengine"):
        config = load_config(given, world_size=1)
    assert caplog.records == []
    assert config.zero_stage == 3
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert given == FEATURES_OFF  # the caller's dict (and its sections) untouched


def test_a_report_zengine_does_not_make_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    given = {
        "train_batch_size": 1,
        "tensorboard": {"enabled": True, "output_path": "runs"},
        "flops_profiler": {"enabled": True},
        "activation_checkpointing": {"partition_activations": True},
    }
    with caplog.at_level("WARNING", logger="zengine"):
        load_config(given, world_size=1)
    assert [r.getMessage() for r in caplog.records] == [
        "zengine: config tensorboard: DeepSpeed's TensorBoard logging, which zengine does not "
        "produce; ignored",
        "zengine: config flops_profiler: DeepSpeed's FLOPs profiler, which zengine does not "
        "produce; ignored",
        "zengine: config activation_checkpointing: the engine does not read it, as "
        "DeepSpeed's does not; zengine.checkpointing.configure(None, deepspeed_config=config) "
        "does; ignored",
    ]


def test_a_feature_that_would_change_the_training_is_refused() -> None:
    problems = _problems(
        {
            "train_batch_size": 1,
            "fp32_allreduce": True,
            "amp": {"enabled": True},
            "bf16": {"enabled": True, "bf16_optimizer_states": True},
            "zero_optimization": {
                "stage": 3,
                "zeropp_loco_param": {"err_beta": 0.8},
                "cpu_offload": True,  # and offload_optimizer too
                "offload_optimizer": {"device": "cpu", "ratio": 0.3},
            },
        }
    )
    assert problems == [
        "zero_optimization.cpu_offload: DeepSpeed's old switch for "
        "zero_optimization.offload_optimizer, which the config also sets; remove cpu_offload",
        "fp32_allreduce: DeepSpeed's fp32 all-reduce, which zengine does not implement (got "
        "True); remove the key or set it to false",
        "amp: DeepSpeed's apex AMP, which zengine does not implement (got {'enabled': True}); "
        'remove the key or set it to "enabled": false; use "fp16" or "bf16"',
        "bf16.bf16_optimizer_states: DeepSpeed's bf16 optimizer states, which zengine does not "
        "implement (got True); remove the key or set it to false",
        "zero_optimization.zeropp_loco_param: DeepSpeed's ZeRO++ LoCo, which zengine does not "
        "implement (got {'err_beta': 0.8}); remove the key or set it to null",
        "zero_optimization.offload_optimizer.ratio: DeepSpeed's partial optimizer offload, "
        "which zengine does not implement (got 0.3); remove the key or set it to 1.0",
    ]


def test_zenflow_is_a_deepspeed_feature_zengine_refuses_not_an_unknown_key() -> None:
    assert _problems(_zero(stage=2, zenflow={"topk_ratio": 0.1})) == [
        "zero_optimization.zenflow: DeepSpeed's ZenFlow (optimizer steps overlapped with "
        "training), which zengine does not implement (got {'topk_ratio': 0.1}); remove the key "
        "or set it to null"
    ]
    assert load_config(_zero(stage=2, zenflow=None), world_size=1).zero_stage == 2


def test_checkpoint_loading_keys_are_deepspeeds(caplog: pytest.LogCaptureFixture) -> None:
    """``pipeline_loading_checkpoint`` (DeepSpeed's rank-by-rank loading, which zstack's
    mapped loads need not) is accepted; ``elastic_checkpoint``, deprecated, is said to be."""
    config = load_config(_zero(stage=3, pipeline_loading_checkpoint=True), world_size=1)
    assert config.zero_stage == 3
    with caplog.at_level("WARNING", logger="zengine"):
        zero = ZeroConfig(stage=3, elastic_checkpoint=True)
    assert zero.elastic_checkpoint
    assert "elastic checkpointing is deprecated" in caplog.text


def test_sum_beside_zenflow_or_deepcompile_is_refused_in_deepspeeds_words() -> None:
    """DeepSpeed's own message comes first, then the feature's refusal."""
    config = {**_zero(stage=2, zenflow={}), "gradient_allreduce_op": "SUM"}
    assert _problems(config)[0] == 'gradient_allreduce_op "sum" is not supported with ZenFlow'
    config = {**_zero(stage=1), "gradient_allreduce_op": "sum", "compile": {"deepcompile": True}}
    assert _problems(config)[0] == 'gradient_allreduce_op "sum" is not supported with DeepCompile'
    assert load_config({**_zero(stage=3), "gradient_allreduce_op": "sum"}, world_size=1)


def test_a_misspelt_deepspeed_key_is_still_unknown() -> None:
    assert _problems({"train_batch_size": 1, "zero_optimization": {"mics_shard_sise": 4}}) == [
        "zero_optimization.mics_shard_sise: unknown key; did you mean 'mics_shard_size'?"
    ]


def test_communication_data_type_is_the_reduction_dtype() -> None:
    config = load_config(
        {"train_batch_size": 1, "bf16": {"enabled": True}, "communication_data_type": "fp32"},
        world_size=1,
    )
    assert config.communication_dtype == torch.float32
    assert config.zero_param_config().reduce_dtype == torch.float32
    assert load_config({"train_batch_size": 1}, world_size=1).communication_dtype is None


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        (
            {"steps_per_print": "10"},
            "steps_per_print: expected an integer or inf (never), got '10'",
        ),
        ({"steps_per_print": 0}, "steps_per_print: must be >= 1, got 0"),
        ({"steps_per_print": 2.5}, "steps_per_print: expected an integer or inf (never), got 2.5"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping: expected a number, got '1.0'"),
        ({"gradient_clipping": -1.0}, "gradient_clipping: must be >= 0, got -1.0"),
        ({"wall_clock_breakdown": 2}, "wall_clock_breakdown: expected true or false, got 2"),
        ({"bf16": {"enabled": 1.0}}, "bf16.enabled: expected true or false, got 1.0"),
        ({"fp16": True}, "fp16: expected an object of keys and values, got True"),
        ({"fp16": {"enabled": "yes"}}, "fp16.enabled: expected true or false, got 'yes'"),
        ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale: must be >= 0, got -1"),
        ({"optimizer": {"params": {}}}, "optimizer.type: required, but not given"),
        (
            {"optimizer": {"type": 3}},
            "optimizer.type: expected 'Adam', 'AdamW', 'SGD', 'Adagrad' or 'Lion', got 3",
        ),
        (
            {"optimizer": {"type": "Adam", "params": []}},
            "optimizer.params: expected an object of keys and values, got []",
        ),
        (
            {"data_types": {"grad_accum_dtype": "fp64"}},
            "data_types.grad_accum_dtype: expected 'fp32', 'fp16' or 'bf16', got 'fp64'",
        ),
        (
            {"communication_data_type": "fp8"},
            "communication_data_type: expected 'fp32', 'fp16' or 'bf16', got 'fp8'",
        ),
        (
            {"host_memory_trim": "always"},
            "host_memory_trim: expected 'idle', 'step' or 'off', got 'always'",
        ),
        (
            {"checkpoint": {"tag_validation": "warning"}},
            "checkpoint.tag_validation: unknown "
            "tag_validation mode 'warning'; did you mean 'WARN'? (supported: IGNORE, WARN, FAIL)",
        ),
        (
            _zero(offload_param={"nvme_path": 3}),
            "zero_optimization.offload_param.nvme_path: expected a path (a string), got 3",
        ),
    ],
)
def test_wrong_values_name_the_expected_type(config: dict[str, Any], problem: str) -> None:
    assert _problems({"train_batch_size": 1, **config}) == [problem]


@pytest.mark.parametrize(
    ("stage", "problem"),
    [
        (4, "zero_optimization.stage: must be 0, 1, 2 or 3, got 4"),
        (-1, "zero_optimization.stage: must be 0, 1, 2 or 3, got -1"),
        ("3", "zero_optimization.stage: expected an integer, got '3'"),
        (True, "zero_optimization.stage: expected an integer, got True"),
    ],
)
def test_bad_stage(stage: Any, problem: str) -> None:
    assert _problems(_zero(stage=stage)) == [problem]


@pytest.mark.parametrize(
    ("key", "value", "what"),
    [
        ("reduce_bucket_size", -1, "must be >= 0, got -1"),
        ("stage3_max_live_parameters", -1e9, "must be >= 0, got -1000000000.0"),
        ("allgather_bucket_size", 5.5e-1, "expected a whole number, got 0.55"),
        ("stage3_prefetch_bucket_size", "5e7", "expected an integer, got '5e7'"),
        ("sub_group_size", float("inf"), "expected a whole number, got inf"),
    ],
)
def test_bad_sizes(key: str, value: Any, what: str) -> None:
    assert _problems(_zero(**{key: value})) == [f"zero_optimization.{key}: {what}"]


def test_unknown_optimizer_suggests_the_closest() -> None:
    config = {"train_batch_size": 1, "optimizer": {"type": "Adamw8bit"}}
    assert _problems(config) == [
        "optimizer.type: unknown optimizer 'Adamw8bit'; did you mean 'AdamW'? "
        "(supported: Adam, AdamW, SGD, Adagrad, Lion)"
    ]


def test_unknown_optimizer_without_a_close_match() -> None:
    config = {"train_batch_size": 1, "optimizer": {"type": "Lamb"}}
    assert _problems(config) == [
        "optimizer.type: unknown optimizer 'Lamb' (supported: Adam, AdamW, SGD, Adagrad, Lion)"
    ]


def test_unknown_scheduler_suggests_the_closest() -> None:
    config = {"train_batch_size": 1, "scheduler": {"type": "WarmupCosine"}}
    assert _problems(config) == [
        "scheduler.type: unknown scheduler 'WarmupCosine'; did you mean 'WarmupCosineLR'? "
        "(supported: WarmupLR, WarmupDecayLR, WarmupCosineLR, "
        "LRRangeTest, OneCycle)"
    ]


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_nvme_offload_needs_a_path(section: str) -> None:
    assert _problems(_zero(stage=3, **{section: {"device": "nvme"}})) == [
        f"zero_optimization.{section}.nvme_path: required when device is 'nvme'"
    ]


def test_bad_offload_device() -> None:
    assert _problems(_zero(offload_optimizer={"device": "gpu"})) == [
        "zero_optimization.offload_optimizer.device: expected 'none', 'cpu' or 'nvme', got 'gpu'"
    ]


@pytest.mark.parametrize("bf16_key", ["bf16", "bfloat16"])
def test_fp16_and_bf16_together(bf16_key: str) -> None:
    config = {"train_batch_size": 1, "fp16": {"enabled": True}, bf16_key: {"enabled": True}}
    assert _problems(config) == [
        f"{bf16_key}.enabled: fp16 and bf16 cannot both be enabled; disable one of them"
    ]


def test_bf16_under_both_names() -> None:
    config = {"train_batch_size": 1, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}}
    assert _problems(config) == [
        "bfloat16: the same key as 'bf16' (another of its names); give only one"
    ]


def test_every_problem_is_reported_at_once() -> None:
    config = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "fp16": {"enabled": True},
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adamm", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 4,
            "stage3_prefetch_bucket_sise": 5e7,
            "reduce_bucket_size": -5,
            "offload_param": {"device": "nvme"},
        },
        "wall_clock_breakdown": "no",
    }
    assert _problems(config, world_size=2) == [
        "optimizer.type: unknown optimizer 'Adamm'; did you mean 'Adam'? "
        "(supported: Adam, AdamW, SGD, Adagrad, Lion)",
        "zero_optimization.stage: must be 0, 1, 2 or 3, got 4",
        "zero_optimization.reduce_bucket_size: must be >= 0, got -5",
        "zero_optimization.offload_param.nvme_path: required when device is 'nvme'",
        "zero_optimization.stage3_prefetch_bucket_sise: unknown key; "
        "did you mean 'stage3_prefetch_bucket_size'?",
        "wall_clock_breakdown: expected true or false, got 'no'",
        "bf16.enabled: fp16 and bf16 cannot both be enabled; disable one of them",
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2"
        " * world size 2 = 16",
    ]


def test_config_error_is_a_value_error_and_pickles() -> None:
    error = ConfigError(["a.b: one", "c: two"])
    assert isinstance(error, ValueError)
    assert str(error) == "a.b: one\nc: two"
    copy = pickle.loads(pickle.dumps(error))
    assert copy.problems == ("a.b: one", "c: two")


# --- batch sizes ------------------------------------------------------------------------

TRAIN, MICRO, ACC = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)


# the arithmetic of the batch sizes: what is given, over how many ranks, and what it resolves to
DERIVED_BATCHES = [
    ({TRAIN: 32}, 1, (32, 32, 1)),
    ({TRAIN: 32}, 4, (32, 8, 1)),
    ({MICRO: 4}, 1, (4, 4, 1)),
    ({MICRO: 4}, 8, (32, 4, 1)),
    ({TRAIN: 32, MICRO: 4}, 2, (32, 4, 4)),
    ({TRAIN: 32, ACC: 2}, 2, (32, 8, 2)),
    ({MICRO: 4, ACC: 2}, 2, (16, 4, 2)),
    ({TRAIN: 16, MICRO: 4, ACC: 2}, 2, (16, 4, 2)),
    ({TRAIN: 1}, 1, (1, 1, 1)),
]


@pytest.mark.parametrize(("given", "world_size", "resolved"), DERIVED_BATCHES)
def test_batch_sizes_are_derived(
    given: dict[str, int], world_size: int, resolved: tuple[int, int, int]
) -> None:
    config = load_config(given, world_size=world_size)
    assert (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    ) == resolved
    assert all(
        type(v) is int
        for v in (
            config.train_batch_size,
            config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps,
        )
    )


# batch sizes that do not add up (the field checks' problems are below)
BAD_BATCHES = [
    (
        {TRAIN: 32, MICRO: 4, ACC: 2},
        2,
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * "
        "gradient_accumulation_steps 2 * world size 2 = 16",
    ),
    (
        {TRAIN: 30, MICRO: 4},
        2,
        "gradient_accumulation_steps: cannot be derived: train_batch_size 30 is not "
        "divisible by train_micro_batch_size_per_gpu 4 * world size 2 = 8",
    ),
    (
        {TRAIN: 4, MICRO: 4},
        2,
        "gradient_accumulation_steps: cannot be derived: train_batch_size 4 is not "
        "divisible by train_micro_batch_size_per_gpu 4 * world size 2 = 8",
    ),
    (
        {TRAIN: 30, ACC: 4},
        2,
        "train_micro_batch_size_per_gpu: cannot be derived: train_batch_size 30 is not "
        "divisible by gradient_accumulation_steps 4 * world size 2 = 8",
    ),
    (
        {TRAIN: 3},
        2,
        "train_micro_batch_size_per_gpu: cannot be derived: train_batch_size 3 is not "
        "divisible by gradient_accumulation_steps 1 * world size 2 = 2",
    ),
    (
        {ACC: 4},
        1,
        "train_batch_size: not given, and neither is train_micro_batch_size_per_gpu; give "
        "at least one of them (train_batch_size = train_micro_batch_size_per_gpu * "
        "gradient_accumulation_steps * world size)",
    ),
]


@pytest.mark.parametrize(
    ("given", "world_size", "problem"),
    [
        *BAD_BATCHES,
        ({TRAIN: 0}, 1, "train_batch_size: must be >= 1, got 0"),
        ({MICRO: 2, ACC: 0}, 1, "gradient_accumulation_steps: must be >= 1, got 0"),
        ({TRAIN: 8.0}, 1, "train_batch_size: expected an integer, got 8.0"),
        ({MICRO: "auto"}, 1, "train_micro_batch_size_per_gpu: expected an integer, got 'auto'"),
    ],
)
def test_bad_batch_sizes(given: dict[str, Any], world_size: int, problem: str) -> None:
    assert _problems(given, world_size) == [problem]


@pytest.mark.parametrize(("given", "world_size", "expected"), [*DERIVED_BATCHES, *BAD_BATCHES])
def test_batch_sizes_resolve_on_their_own_as_in_a_config(
    given: dict[str, int], world_size: int, expected: tuple[int, int, int] | str
) -> None:
    """What DeepSpeed's ``DeepSpeedConfig._configure_train_batch_size`` does after its batch
    sizes were changed: the same arithmetic and the same problems as `load_config`'s."""
    sizes = (given.get(TRAIN), given.get(MICRO), given.get(ACC))
    if isinstance(expected, tuple):
        assert resolve_batch_sizes(*sizes, world_size=world_size) == expected
    else:
        with pytest.raises(ConfigError) as raised:
            resolve_batch_sizes(*sizes, world_size=world_size)
        assert raised.value.problems == (expected,)


@pytest.mark.parametrize(("key", "value"), [(TRAIN, 0), (MICRO, 2.0), (ACC, True)])
def test_batch_sizes_on_their_own_must_be_positive_ints(key: str, value: Any) -> None:
    sizes = {TRAIN: 4, MICRO: None, ACC: None, key: value}
    with pytest.raises(ConfigError, match=f"^{key}: expected a positive integer, got {value!r}$"):
        resolve_batch_sizes(sizes[TRAIN], sizes[MICRO], sizes[ACC], world_size=1)


# --- one section on its own -----------------------------------------------------------------


def test_a_section_reads_on_its_own_with_its_defaults() -> None:
    """DeepSpeed's ``get_bfloat16_config(param_dict)``: no batch sizes needed."""
    bf16 = read_section({"bfloat16": {"enabled": True}}, "bf16")
    assert isinstance(bf16, BF16Config)
    assert bf16.enabled is True
    assert read_section({"bf16": {"enabled": True}}, "bfloat16") == bf16
    assert (
        read_section({}, "zero_optimization")
        == load_config({TRAIN: 1}, world_size=1).zero_optimization
    )
    # DeepSpeed keys of features zengine lacks: set aside as load_config sets them
    assert read_section({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16") == bf16


@pytest.mark.parametrize(
    ("config", "key", "problem"),
    [
        ({"bf16": {"enabled": "yes"}}, "bf16", "bf16.enabled: expected true or false, got 'yes'"),
        ({}, "steps_per_print", "steps_per_print: not a section of the config (sections: fp16, "),
        ({}, "bf17", "bf17: not a section of the config"),
        (
            {"zero_optimization": {"zenflow": {}}},
            "zero_optimization",
            "zero_optimization.zenflow: DeepSpeed's ZenFlow",
        ),
    ],
)
def test_a_bad_section_on_its_own_names_the_key(config: Any, key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        read_section(config, key)
    assert raised.value.problems[0].startswith(problem)


STAGE3_KEYS = {
    "prefetch_bucket_size": 7,
    "param_persistence_threshold": 8,
    "model_persistence_threshold": 9,
    "max_live_parameters": 10,
    "max_reuse_distance": 11,
    "module_granularity_threshold": 12,
    "gather_16bit_weights_on_model_save": True,
}


def test_stage3_keys_without_their_prefix() -> None:
    """DeepSpeed's fields are named without ``stage3_`` (the prefixed names are their aliases),
    and its own tests write them so."""
    zero = load_config(_zero(stage=3, **STAGE3_KEYS), world_size=1).zero_optimization
    assert {k: getattr(zero, f"stage3_{k}") for k in STAGE3_KEYS} == STAGE3_KEYS
    # and read back under DeepSpeed's attribute names (DeepSpeedZeroConfig's)
    assert {k: getattr(zero, k) for k in STAGE3_KEYS} == STAGE3_KEYS
    assert _problems(_zero(stage=3, max_live_parameters=1, stage3_max_live_parameters=2)) == [
        "zero_optimization.max_live_parameters: the same key as 'stage3_max_live_parameters' "
        "(another of its names); give only one"
    ]


def test_deepspeed_old_offload_switches_are_read_as_their_sections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="zengine"):
        zero = load_config(
            _zero(
                stage=3, cpu_offload=True, cpu_offload_param=True, cpu_offload_use_pin_memory=True
            ),
            world_size=1,
        ).zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_param.device) == ("cpu", "cpu")
    assert [r.getMessage() for r in caplog.records] == [
        f'zengine: config zero_optimization.{old}: DeepSpeed\'s old switch, read as "{new}": '
        '{"device": "cpu"}; write that instead'
        for old, new in (
            ("cpu_offload", "offload_optimizer"),
            ("cpu_offload_param", "offload_param"),
        )
    ]
    off = load_config(_zero(stage=3, cpu_offload=False, cpu_offload_param=None), world_size=1)
    assert off.zero_optimization.offload_optimizer.device == "none"
    assert off.zero_optimization.offload_param.device == "none"
    assert _problems(_zero(stage=3, cpu_offload="yes")) == [
        "zero_optimization.cpu_offload: expected true or false, got 'yes'"
    ]
    assert _problems(_zero(stage=1, cpu_ofload=True)) == [
        "zero_optimization.cpu_ofload: unknown key; did you mean 'cpu_offload'?"
    ]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_grad_accum_dtype_at_stages_0_to_2_is_fp32_or_the_compute_dtype(stage: int) -> None:
    config = {
        "train_batch_size": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
    }
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        loaded = load_config({**config, "data_types": {"grad_accum_dtype": name}}, world_size=1)
        assert loaded.accumulation_dtype == dtype
    # DeepSpeed's default: fp32 for bf16 without ZeRO (its BF16_Optimizer), else the compute's
    default = load_config(config, world_size=1).accumulation_dtype
    assert default == (torch.float32 if stage == 0 else torch.bfloat16)
    assert _problems({**config, "data_types": {"grad_accum_dtype": "fp16"}}) == [
        "data_types.grad_accum_dtype: fp16 is neither fp32 nor the compute dtype (bf16); ZeRO "
        "stages 0-2 accumulate gradients in one of those, another dtype works at stage 3 only "
        f"(the stage is {stage})"
    ]


def test_bf16_check_grad_overflow_and_torch_adam_outside_params(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DeepSpeed's bf16 switch is taken (zengine checks always: false warns), and torch_adam
    at the top of the optimizer section is ignored, as DeepSpeed ignores it there."""
    base = {"train_batch_size": 1, "optimizer": {"type": "Adam", "torch_adam": True}}
    with caplog.at_level("WARNING", logger="zengine"):
        on = load_config(
            {**base, "bf16": {"enabled": True, "check_grad_overflow": True}}, world_size=1
        )
    assert on.bf16.check_grad_overflow
    assert on.optimizer is not None
    assert "torch_adam" not in on.optimizer.params
    assert caplog.records == []
    with caplog.at_level("WARNING", logger="zengine"):
        load_config({**base, "bf16": {"enabled": True, "check_grad_overflow": False}}, world_size=1)
    assert [r.getMessage() for r in caplog.records] == [
        "zengine: config bf16.check_grad_overflow: false: zengine still checks the gradients "
        "for inf and NaN, and skips such a step (nonfinite_gradients: 'skip')"
    ]


def test_deepspeeds_other_dtype_spellings() -> None:
    # "bfp16" is DeepSpeed's communication_data_type spelling; its data_types take its
    # DtypeEnum's names; any case
    for given, name in (
        ("bfp16", "bf16"),
        ("BF16", "bf16"),
        ("bfloat16", "bf16"),
        ("half", "fp16"),
    ):
        config = load_config(
            {
                "train_batch_size": 1,
                "communication_data_type": given,
                "data_types": {"grad_accum_dtype": given},
                "zero_optimization": {"stage": 3},
            },
            world_size=1,
        )
        assert config.communication_data_type == name
        assert config.data_types.grad_accum_dtype == name
    # at stages 0-2 a spelled-out bf16 under fp16 is still refused by what it is
    assert _problems(
        {
            "train_batch_size": 1,
            "fp16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "bfloat16"},
        }
    ) == [
        "data_types.grad_accum_dtype: bf16 is neither fp32 nor the compute dtype (fp16); ZeRO "
        "stages 0-2 accumulate gradients in one of those, another dtype works at stage 3 only "
        "(the stage is 0)"
    ]


def test_config_reads_like_deepspeeds_dict() -> None:
    """DeepSpeed's ``engine.config`` is the config dict; Transformers' Trainer reads
    ``engine.config.get("zero_optimization", {}).get("stage")``, so the sections answer dict
    reads by DeepSpeed's keys (aliases too), defaults filled in."""
    config = load_config(
        {"train_batch_size": 2, "zero_optimization": {"stage": 3}, "bfloat16": {"enabled": True}},
        world_size=1,
    )
    assert config.get("zero_optimization", {}).get("stage", None) == 3
    assert config["train_batch_size"] == 2
    assert config.get("bfloat16").get("enabled") is True  # DeepSpeed's older name of bf16
    assert config.get("optimizer", {}) == {}  # not given
    assert "optimizer" not in config
    assert "zero_optimization" in config
    assert config.get("no_such_key") is None
    with pytest.raises(KeyError, match="no_such_key"):
        config["no_such_key"]
