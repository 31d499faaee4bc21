"""Config keys that change what the engine does with the inputs: ``fp16.auto_cast`` casts the
forward's floating-point inputs (the first stage's, in a pipeline) to float16, as DeepSpeed's
engine does; ``dataloader_drop_last`` decides whether the loader built from ``training_data``
keeps a last, shorter micro-batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import zengine
from zcomm.testing import DistributedTest
from zengine.pipe import PipelineEngine, PipelineModule


class DtypeProbe(nn.Module):
    """Records the dtypes of what its forward gets; a loss from a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen: list[tuple[torch.dtype, ...]] = []

    def forward(self, x: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
        self.seen.append((x.dtype, extra["scale"].dtype, extra["ids"].dtype))
        y = self.lin(x.to(self.lin.weight.dtype)) * extra["scale"].to(x.dtype)
        return y.float().square().mean()


def _config(auto_cast: bool | None) -> dict[str, Any]:
    fp16: dict[str, Any] = {"enabled": True}
    if auto_cast is not None:
        fp16["auto_cast"] = auto_cast
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fp16": fp16,
    }


class TestAutoCast(DistributedTest):
    world_size = 1

    @pytest.mark.parametrize(
        ("auto_cast", "floats"), [(True, torch.float16), (False, torch.float32)]
    )
    def test_floating_inputs_are_cast_only_when_asked(
        self, auto_cast: bool, floats: torch.dtype
    ) -> None:
        model = DtypeProbe()
        engine, *_ = zengine.initialize(model=model, config=_config(auto_cast))
        extra = {"scale": torch.ones(2, 1), "ids": torch.arange(2)}
        loss = engine(torch.randn(2, 4), extra)
        engine.backward(loss)
        engine.step()
        assert model.seen == [(floats, floats, torch.int64)]  # integers stay as they are

    def test_the_first_stage_of_a_pipeline_gets_them_cast(self) -> None:
        stage = nn.Sequential(nn.Linear(4, 4))
        seen: list[torch.dtype] = []
        stage.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
        module = PipelineModule([stage, nn.Linear(4, 1)], num_stages=1, loss_fn=_mse)
        config = {**_config(True), "gradient_accumulation_steps": 2}
        engine, *_ = zengine.initialize(model=module, config=config)
        assert isinstance(engine, PipelineEngine)
        batch = (torch.randn(2, 4), torch.randn(2, 1))
        engine.train_batch(iter([batch, batch]))
        assert seen == [torch.float16, torch.float16]


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).square().mean()


class TestDataLoader(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize(("drop_last", "sizes"), [(False, [2, 2, 1]), (True, [2, 2])])
    def test_the_last_short_micro_batch(self, drop_last: bool | None, sizes: list[int]) -> None:
        # 10 samples over 2 ranks: 5 each, in micro-batches of 2
        data = TensorDataset(torch.arange(10.0).view(10, 1))
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "dataloader_drop_last": drop_last,
        }
        _, _, loader, _ = zengine.initialize(
            model=nn.Linear(1, 1), config=config, training_data=data
        )
        assert loader is not None
        assert [len(batch[0]) for batch in loader] == sizes
