"""What `initialize` refuses as DeepSpeed does: a client optimizer with ZeRO-Offload, an
``allgather_bucket_size`` off the partitions' alignment. Both are `zengine.UsageError` (the
compat package's ``ZeRORuntimeException``), naming the key that decides."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zengine
from zcomm.testing import DistributedTest
from zengine.ops.adam import DeepSpeedCPUAdam
from zengine.ops.lion import DeepSpeedCPULion


def _config(stage: int, **zero: Any) -> dict[str, Any]:
    return {"train_batch_size": 2, "zero_optimization": {"stage": stage, **zero}}


def _offloaded(**extra: Any) -> dict[str, Any]:
    return {**_config(1, offload_optimizer={"device": "cpu"}), **extra}


class TestClientOptimizerWithOffload(DistributedTest):
    @pytest.mark.parametrize("world_size", [1])
    def test_a_torch_optimizer_is_refused_naming_the_switch(self, world_size: int) -> None:
        model = nn.Linear(4, 4)
        weight = model.weight.detach().clone()
        with pytest.raises(zengine.UsageError, match="zero_force_ds_cpu_optimizer") as error:
            zengine.initialize(
                model=model, optimizer=torch.optim.Adam(model.parameters()), config=_offloaded()
            )
        assert isinstance(error.value, AssertionError)  # what DeepSpeed's asserts raise
        assert "Adam" in str(error.value)
        assert "offload_optimizer" in str(error.value)
        assert torch.equal(model.weight, weight)  # refused before anything changed

    @pytest.mark.parametrize("world_size", [1])
    def test_a_factory_is_checked_on_what_it_builds(self, world_size: int) -> None:
        with pytest.raises(zengine.UsageError, match="zero_force_ds_cpu_optimizer"):
            zengine.initialize(
                model=nn.Linear(4, 4),
                optimizer=lambda groups: torch.optim.SGD(groups, lr=0.1),
                config=_offloaded(),
            )

    @pytest.mark.parametrize("world_size", [1])
    def test_what_deepspeed_lets_through(self, world_size: int) -> None:
        for make, extra in [
            (lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3), {}),
            (lambda ps: DeepSpeedCPULion(ps, lr=1e-3), {}),
            (lambda ps: torch.optim.Adam(ps), {"zero_force_ds_cpu_optimizer": False}),
        ]:
            model = nn.Linear(4, 4)
            engine, *_ = zengine.initialize(
                model=model, optimizer=make(model.parameters()), config=_offloaded(**extra)
            )
            engine.destroy()
        # no offload: any optimizer
        model = nn.Linear(4, 4)
        engine, *_ = zengine.initialize(
            model=model, optimizer=torch.optim.Adam(model.parameters()), config=_config(1)
        )
        engine.destroy()


class TestAllgatherBucketSize(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("stage", [1, 2])
    def test_an_odd_size_is_refused_at_stages_1_and_2(self, world_size: int, stage: int) -> None:
        cfg = {**_config(stage, allgather_bucket_size=1001), "optimizer": {"type": "Adam"}}
        with pytest.raises(zengine.UsageError) as error:
            zengine.initialize(model=nn.Linear(4, 4), config=cfg)
        assert isinstance(error.value, AssertionError)
        assert str(error.value).startswith(
            "zero_optimization.allgather_bucket_size: allgather_bucket_size must be a multiple "
            "of nccl_start_alignment_factor, 2 (got 1001"
        )

    @pytest.mark.parametrize("world_size", [1])
    def test_other_sizes_and_stages_pass(self, world_size: int) -> None:
        for stage, size in [(1, 1000), (2, 1000), (0, 1001), (3, 1001)]:
            cfg = {**_config(stage, allgather_bucket_size=size), "optimizer": {"type": "Adam"}}
            engine, *_ = zengine.initialize(model=nn.Linear(4, 4), config=cfg)
            engine.destroy()


def test_the_error_type_is_public() -> None:
    assert "UsageError" in zengine.__all__
    assert issubclass(zengine.UsageError, RuntimeError)
    assert issubclass(zengine.UsageError, AssertionError)
