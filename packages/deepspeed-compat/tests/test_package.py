"""The distribution itself: found by name and version as Transformers and Accelerate look for
DeepSpeed, its version says what it is, and refused features raise where they are called."""

from __future__ import annotations

import importlib.metadata
from typing import cast

import pytest
import torch
import torch.distributed as dist
from packaging.version import Version

import deepspeed
import zengine
import zpartition
from deepspeed.utils import groups
from unit.common import DistributedTest


def test_found_as_deepspeed_with_a_zstack_label() -> None:
    version = Version(importlib.metadata.version("deepspeed"))
    assert str(version) == deepspeed.__version__
    assert version.local is not None
    assert version.local.startswith("zstack")
    assert version >= Version("0.9.3")  # Transformers' requirement
    assert (deepspeed.__version_major__, deepspeed.__version_minor__) == (0, 19)


def test_transformers_and_accelerate_see_deepspeed() -> None:
    from accelerate.utils import is_deepspeed_available as accelerate_sees
    from transformers.dependency_versions_check import dep_version_check
    from transformers.integrations import is_deepspeed_available as transformers_sees

    assert transformers_sees()
    assert accelerate_sees()
    dep_version_check("deepspeed")  # raises when the version does not satisfy Transformers


def test_names_are_zstacks_own_objects() -> None:
    """Adapters only: the names are the very objects of zstack's packages."""
    assert deepspeed.initialize is zengine.initialize
    # zengine's Init is zpartition's, handed an NVMe shard store when offload_param asks
    assert deepspeed.zero.Init is zengine.zero.Init
    assert issubclass(zengine.zero.Init, zpartition.Init)
    assert deepspeed.zero.GatheredParameters is zpartition.GatheredParameters
    assert deepspeed.DeepSpeedEngine is zengine.Engine
    assert deepspeed.runtime.engine.DeepSpeedEngine is zengine.Engine
    assert deepspeed.comm.all_reduce is __import__("zcomm").all_reduce


@pytest.mark.parametrize(
    ("use", "feature"),
    [
        (lambda: deepspeed.tp_model_init(model=None, tp_size=2, dtype=None), "tensor parallel"),
        (lambda: groups._get_sequence_parallel_group(), "sequence parallel"),
        (
            lambda: (
                deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF.register_with_transformers
            ),
            "sequence parallel",
        ),
        (lambda: groups._get_expert_parallel_group("ep_size_2"), "expert parallel"),
        (lambda: deepspeed.init_inference(None), "DeepSpeed-Inference"),
    ],
)
def test_refused_features_raise_at_the_call_naming_the_feature(use: object, feature: str) -> None:
    with pytest.raises(deepspeed.UnsupportedFeatureError, match=feature) as raised:
        use()  # type: ignore[operator]
    assert "zstack" in str(raised.value)


class TestDataParallelGroup(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_the_data_parallel_group_is_the_world(self, world_size: int) -> None:
        assert groups._get_data_parallel_world_size() == dist.get_world_size()
        assert groups._get_data_parallel_rank() == dist.get_rank()
        assert dist.get_world_size(groups._get_data_parallel_group()) == dist.get_world_size()


def test_op_builders_say_every_feature_is_there_and_refuse_to_build() -> None:
    """DeepSpeed's code asks a builder before using CPU Adam or async I/O; zstack needs no
    build for either (torch's kernels, zoffload's NVMe files), and has no compiled op to hand."""
    from deepspeed.ops.aio import AsyncIOBuilder
    from deepspeed.ops.op_builder import CPUAdamBuilder

    assert deepspeed.ops.__compatible_ops__[CPUAdamBuilder.NAME]
    assert deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]
    with pytest.raises(deepspeed.UnsupportedFeatureError, match="NVMe offload is zoffload's"):
        AsyncIOBuilder().load()


def test_deepspeeds_base_optimizer_classes_are_zengines() -> None:
    """zengine has one ZeRO optimizer, for every stage: DeepSpeed's base class and its bf16
    optimizer are it."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    for name in (ZeROOptimizer, BF16_Optimizer):
        assert name is zengine.ZeroOptimizer


class TestOptimizerKinds(DistributedTest):
    """``isinstance(engine.optimizer, <DeepSpeed's class>)`` holds for the class DeepSpeed
    would have built at that stage and precision, and not for the others (DeepSpeed's tests
    branch on it, then read that class's attributes)."""

    world_size = 2

    @pytest.mark.parametrize(
        ("stage", "bf16", "kind"),
        [
            (0, True, "FP16_Optimizer"),
            (0, False, None),
            (1, False, "DeepSpeedZeroOptimizer"),
            (2, True, "DeepSpeedZeroOptimizer"),
            (3, False, "DeepSpeedZeroOptimizer_Stage3"),
        ],
    )
    def test_the_stage_decides(self, stage: int, bf16: bool, kind: str | None) -> None:
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        kinds = {
            "FP16_Optimizer": FP16_Optimizer,
            "FP16_UnfusedOptimizer": FP16_UnfusedOptimizer,
            "DeepSpeedZeroOptimizer": DeepSpeedZeroOptimizer,
            "DeepSpeedZeroOptimizer_Stage3": DeepSpeedZeroOptimizer_Stage3,
        }
        model = torch.nn.Linear(4, 4)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": bf16},
        }
        _, optimizer, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        assert {name for name, cls in kinds.items() if isinstance(optimizer, cls)} == (
            {kind} if kind else set()
        )
        assert issubclass(zengine.ZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)
        with pytest.raises(TypeError, match=r"built by deepspeed\.initialize"):
            DeepSpeedZeroOptimizer()
        if kind == "FP16_Optimizer":  # and the attributes of that class are there
            assert optimizer is not None
            assert [t.dtype for t in optimizer.fp32_groups_flat] == [torch.float32]


def test_comm_dtype_attribute_is_the_one_zengine_reads() -> None:
    from deepspeed.runtime.torch_autocast import PARAM_COMM_DTYPE_ATTR_NAME, has_comm_dtype

    param = torch.nn.Parameter(torch.ones(2))
    assert not has_comm_dtype(param)
    setattr(param, PARAM_COMM_DTYPE_ATTR_NAME, torch.bfloat16)
    assert has_comm_dtype(param)


def test_torch_version_checks_and_grad_hooks() -> None:
    """``deepspeed.utils.torch``: DeepSpeed's test models guard on the torch version with it."""
    from deepspeed.utils.torch import (
        is_functorch_transforming,
        register_grad_hook,
        required_torch_version,
    )

    installed = Version(torch.__version__.split("+")[0])
    assert required_torch_version(min_version=1.8)
    assert required_torch_version(min_version=f"{installed.major}.{installed.minor}")
    assert not required_torch_version(min_version=f"{installed.major}.{installed.minor + 1}")
    assert not required_torch_version(max_version=1.8)
    with pytest.raises(ValueError, match="min_version or max_version"):
        required_torch_version()
    assert not is_functorch_transforming()
    assert torch.func.grad(lambda x: (x * is_functorch_transforming()).sum())(torch.ones(2)).sum()
    param = torch.nn.Parameter(torch.ones(2))
    seen: list[torch.Tensor] = []

    def keep(p: torch.Tensor) -> None:
        assert p.grad is not None
        seen.append(p.grad.clone())

    register_grad_hook(param, keep)
    (param * 3).sum().backward()  # type: ignore[no-untyped-call]
    assert len(seen) == 1
    assert torch.equal(seen[0], torch.full((2,), 3.0))


class TestMiCSInit(DistributedTest):
    world_size = 4

    def test_shards_within_the_configs_shard_groups(self) -> None:
        # DeepSpeed's MiCS_Init with mics_shard_size 2 on 4 ranks: 2 shard groups of 2, and
        # the engine built on the same config takes the model as it was cut
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "mics_shard_size": 2},
        }
        with deepspeed.zero.MiCS_Init(config_dict_or_path=config):
            model = torch.nn.Linear(6, 5)
        weight = cast(zpartition.ZeroParameter, model.weight)
        assert weight.ds_tensor.numel() == 15  # 30 elements over 2 ranks
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.backward(engine(torch.ones(1, 6)).sum())
        engine.step()
        with pytest.raises(ValueError, match="mics_shard_size must be set"):
            deepspeed.zero.MiCS_Init(config_dict_or_path={"zero_optimization": {"stage": 3}})
