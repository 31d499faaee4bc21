"""The ``deepspeed`` names DeepSpeed's own runtime and checkpoint tests import (and scripts
written against DeepSpeed's runtime), checked as `test_names` checks the Hugging Face
libraries' (the import succeeds and every attribute read after it finds something). The
DeepSpeed test that reads each is in the comment above it; the README counts those files."""

from __future__ import annotations

import pytest

from test_names import _resolves, _use

NAMES = [
    # unit/runtime/test_lr_schedulers.py, test_ds_initialize.py
    *(
        f"deepspeed.runtime.lr_schedules.{name}"
        for name in [
            "LR_RANGE_TEST",
            "LR_RANGE_TEST_MIN_LR",
            "LR_RANGE_TEST_STEP_RATE",
            "LR_RANGE_TEST_STEP_SIZE",
            "LR_RANGE_TEST_STAIRCASE",
            "WARMUP_LR",
            "WARMUP_MIN_LR",
            "WARMUP_MAX_LR",
            "WARMUP_NUM_STEPS",
            "WARMUP_TYPE",
            "WARMUP_LOG_RATE",
            "WARMUP_LINEAR_RATE",
            "ONE_CYCLE",
            "CYCLE_MIN_LR",
            "CYCLE_MAX_LR",
            "CYCLE_FIRST_STEP_SIZE",
            "DECAY_LR_RATE",
            "DECAY_STEP_SIZE",
            "CYCLE_MIN_MOM",
            "CYCLE_MAX_MOM",
            "DECAY_MOM_RATE",
            "WARMUP_DECAY_LR",
            "TOTAL_NUM_STEPS",
            "WARMUP_COSINE_LR",
            "WARMUP_MIN_RATIO",
            "COS_MIN_RATIO",
            "WarmupCosineLR",
            "WarmupLR",
            "WarmupDecayLR",
            "LRRangeTest",
            "OneCycle",
            "VALID_LR_SCHEDULES",
            "add_tuning_arguments",
            "get_config_from_args",
        ]
    ),
    # unit/runtime/test_ds_config_dict.py, test_ds_initialize.py
    "deepspeed.runtime.config.DeepSpeedConfig",
    "deepspeed.runtime.config.ADAM_OPTIMIZER",
    "deepspeed.runtime.precision_config.get_bfloat16_config",
    "deepspeed.runtime.precision_config.DeepSpeedFP16Config",
    "deepspeed.runtime.zero.config.DeepSpeedZeroConfig",
    "deepspeed.__git_hash__",
    "deepspeed.__git_branch__",
    "deepspeed.__version_major__",
    # unit/checkpoint/common.py, test_ds_initialize.py; scripts' loss scalers
    "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer",
    "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.CreateLossScaler",
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus",
    # unit/runtime/test_autocast.py, unit/v1/zero/test_zero_functorch_linear.py
    "deepspeed.runtime.zero.linear.LinearModuleForZeroStage3",
    "deepspeed.runtime.zero.linear.LinearFunctionForZeroStage3",
    "deepspeed.runtime.zero.linear.zero3_linear_wrap",
    "deepspeed.runtime.zero.linear.autocast_custom_fwd",
    "deepspeed.runtime.zero.linear.autocast_custom_bwd",
    "deepspeed.runtime.zero.linear.noop_decorator",
    "deepspeed.utils.torch.required_torch_version",
    # unit/checkpoint/test_pipeline.py, test_zero_optimizer.py, test_universal_checkpoint.py
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine",
    "deepspeed.runtime.checkpoint_engine.checkpoint_engine.CheckpointEngine",
    "deepspeed.runtime.checkpoint_engine.checkpoint_engine.CheckpointCommitInfo",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "deepspeed.checkpoint.utils.get_model_ckpt_name_for_rank",
    "deepspeed.checkpoint.utils.get_zero_ckpt_name_for_rank",
    "deepspeed.checkpoint.utils.get_layer_ckpt_name_for_rank",
    "deepspeed.checkpoint.UNIVERSAL_CHECKPOINT_INFO",
    "deepspeed.checkpoint.constants.PARAM",
    "deepspeed.checkpoint.constants.OPTIMIZER_STATE_DICT",
    "deepspeed.checkpoint.constants.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS",
    "deepspeed.checkpoint.constants.TP_REPLICATED_PARAMETER_PATTERNS",
    "deepspeed.checkpoint.constants.ORIGINAL_VOCAB_SIZE",
    # unit/checkpoint/test_latest_checkpoint.py
    "deepspeed.ops.op_builder.FusedAdamBuilder",
]


@pytest.mark.parametrize("name", NAMES)
def test_a_name_deepspeeds_tests_import_resolves(name: str) -> None:
    assert _resolves(_use(name, name)), f"from {name.rpartition('.')[0]} import ..."
    # ``import deepspeed`` alone reaches it too, as DeepSpeed's package imports its submodules
    assert _resolves(_use(name)), f"{name} after a bare `import deepspeed`"
