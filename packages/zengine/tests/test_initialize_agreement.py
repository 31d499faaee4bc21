"""Ranks whose configs or models differ stop at `initialize` with an error naming the difference,
on every rank, rather than hang or abort in a later collective ([Note: agreement at
initialize]); and the optimizer's and scheduler's params of the wrong type are named by key."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zengine.pipe import LayerSpec, PipelineModule

from ._helpers import TinyGPT, engine_config


def _stage3(**zero: Any) -> dict[str, Any]:
    cfg = engine_config(3)
    cfg["zero_optimization"] |= zero
    return cfg


def _mismatch(config: dict[str, Any], model: nn.Module | None = None) -> str:
    """The `RankMismatchError` `initialize` raises on this rank, as one string."""
    torch.manual_seed(0)
    with pytest.raises(zengine.RankMismatchError) as caught:
        zengine.initialize(model=model or TinyGPT(), config=config)
    return str(caught.value)


class TestAgreementTwoRanks(DistributedTest):
    world_size = 2
    exec_timeout = 120  # a hang fails the test well before the process group's timeout

    def test_differences_are_named_on_every_rank(self) -> None:
        rank = zcomm.get_rank()
        # a ZeRO-3 knob: gloo aborted a rank (DeepSpeed: the first step hangs)
        message = _mismatch(_stage3(stage3_param_persistence_threshold=16 if rank else 0))
        assert "config zero_optimization.stage3_param_persistence_threshold: " in message
        assert "rank 0 has 0; rank 1 has 16" in message
        assert message.count("\n  config ") == 1  # only the differing key is named

        # one rank's model has another width: the parameters named, each rank's shape
        width = 12 if rank == 1 else 16
        model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))
        message = _mismatch(engine_config(3), model)
        assert "3 parameter(s) differ:" in message
        assert "parameter '0.weight': rank 0 has shape (16, 8), float32, requires_grad=True" in (
            message
        )
        assert "rank 1 has shape (12, 8)" in message
        assert "config " not in message  # the configs agree

        # rank 1's config cannot be read: it raises its own error, rank 0 one naming it
        cfg = engine_config(2)
        cfg["optimizer"]["params"]["lr"] = "1e-2" if rank == 1 else 1e-2
        torch.manual_seed(0)
        expected = zengine.ConfigError if rank == 1 else zengine.RankMismatchError
        with pytest.raises(expected) as caught:
            zengine.initialize(model=TinyGPT(), config=cfg)
        assert "optimizer.params.lr: expected a number, got the string '1e-2'" in str(caught.value)
        if rank == 0:
            assert "rank 1 could not read the config or the model" in str(caught.value)

        # a pipeline's stages (one rank each) agree on the config as well
        module = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4)], 2)
        cfg = engine_config(0, gradient_clipping=1.0 + rank)
        message = _mismatch(cfg, module)
        assert "config gradient_clipping: rank 0 has 1.0; rank 1 has 2.0" in message

        # and agreeing ranks go on: the process group is as it was
        engine, *_ = zengine.initialize(model=TinyGPT(), config=engine_config(3))
        engine.backward(engine(torch.zeros(2, 4, dtype=torch.long)))
        engine.step()


class TestAgreementFourRanks(DistributedTest):
    world_size = 4
    exec_timeout = 120

    def test_group_sizes_differ(self) -> None:
        # the group sizes that hung for the process group's timeout (30 minutes)
        size = 2 if zcomm.get_rank() == 0 else 4
        message = _mismatch(_stage3(mics_shard_size=size))
        assert "config zero_optimization.mics_shard_size: rank 0 has 2; ranks 1-3 have 4" in message
        message = _mismatch(_stage3(zero_hpz_partition_size=size))
        key = "zero_optimization.zero_hpz_partition_size"
        assert f"config {key}: rank 0 has 2; ranks 1-3 have 4" in message


_BAD_PARAMS = [
    ("optimizer", {"lr": "1e-2"}, "optimizer.params.lr: expected a number, got the string '1e-2'"),
    ("optimizer", {"lr": "auto"}, "optimizer.params.lr: expected a number, got 'auto'"),
    ("optimizer", {"betas": "0.9,0.99"}, "optimizer.params.betas: expected a list of two numbers"),
    ("optimizer", {"betas": [0.9]}, "optimizer.params.betas: expected a list of two numbers"),
    ("optimizer", {"eps": True}, "optimizer.params.eps: expected a number, got True"),
    ("optimizer", {"amsgrad": "yes"}, "optimizer.params.amsgrad: expected true or false"),
    ("scheduler", {"warmup_num_steps": "10"}, "scheduler.params.warmup_num_steps: expected an"),
    ("scheduler", {"warmup_num_steps": 2.5}, "scheduler.params.warmup_num_steps: expected an"),
    ("scheduler", {"warmup_max_lr": "1e-3"}, "scheduler.params.warmup_max_lr: expected a number"),
    ("scheduler", {"cycle_momentum": 2}, "scheduler.params.cycle_momentum: expected true or"),
]


def _typed_config(section: str, params: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {}},
    }
    cfg[section]["params"] |= params
    return cfg


@pytest.mark.parametrize(("section", "params", "line"), _BAD_PARAMS)
def test_params_of_the_wrong_type_are_named_by_key(
    section: str, params: dict[str, Any], line: str
) -> None:
    with pytest.raises(zengine.ConfigError) as caught:
        zengine.load_config(_typed_config(section, params), world_size=1)
    assert line in str(caught.value)


def test_params_of_the_right_type_pass_as_written() -> None:
    optimizer = {"lr": 1, "betas": (0.9, 0.99), "eps": 1e-8, "amsgrad": 1, "foreach": None}
    scheduler = {"warmup_num_steps": 1e3, "warmup_max_lr": [1e-3, 2e-3], "warmup_type": "linear"}
    cfg = _typed_config("optimizer", optimizer)
    cfg["scheduler"]["params"] = scheduler
    loaded = zengine.load_config(cfg, world_size=1)
    assert loaded.optimizer is not None
    assert loaded.scheduler is not None
    assert loaded.optimizer.params == optimizer
    assert loaded.scheduler.params == scheduler
