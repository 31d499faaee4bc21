"""The distribution itself: found by name and version as Transformers and Accelerate look for
DeepSpeed, its version says what it is, and refused features raise where they are called."""

from __future__ import annotations

import importlib.metadata

import pytest
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
    assert deepspeed.zero.Init is zpartition.Init
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
        (lambda: deepspeed.zero.MiCS_Init(), "hybrid sharding"),
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
