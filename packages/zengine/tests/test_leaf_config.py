"""``zero_optimization.leaf_module`` (DeepSpeed's config-driven ZeRO-3 leaf modules): the section
read as DeepSpeed reads it, the modules it names marked before the engine partitions the model,
and training with them equal to plain PyTorch."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch

import zcomm
import zengine
import zpartition
from zcomm.testing import DistributedTest
from zengine.config import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig, ZeroConfig

from ._helpers import Block, TinyGPT, global_batches, plain_losses

LR = 1e-2


def test_the_section_reads_as_deepspeeds() -> None:
    assert ZeroConfig().leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES  # Hugging Face's MoE
    # as DeepSpeed's tests build it: DeepSpeedZeroConfig(**section)
    assert ZeroConfig.model_validate({"leaf_module": None}).leaf_module == LeafModuleConfig()
    leaf = {"classes": "my.Class", "names": "a", "name_suffixes": "tail"}
    one = ZeroConfig.model_validate({"leaf_module": leaf})
    expected = LeafModuleConfig(classes=["my.Class"], names=["a"], name_suffixes=["tail"])
    assert one.leaf_module == expected
    twice = LeafModuleConfig(names=["a", "b", "a"])
    assert twice.names == ["a", "b"]
    with pytest.raises(zengine.ConfigError, match=r"leaf_module.clases: unknown key; did you mean"):
        zengine.load_config(
            {"train_batch_size": 1, "zero_optimization": {"leaf_module": {"clases": []}}},
            world_size=1,
        )


def _config(leaf_module: dict[str, Any]) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "leaf_module": leaf_module,
        },
    }


# each way of naming the two blocks of TinyGPT
SECTIONS = {
    "class name": {"classes": ["Block"]},
    "qualified class name": {"classes": [f"{Block.__module__}.{Block.__qualname__}"]},
    "names": {"names": ["blocks.0", "blocks.1"]},
    "suffixes": {"name_suffixes": ["blocks.0", "s.1"]},
}


class TestConfiguredLeaves(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize("section", list(SECTIONS))
    def test_marked_and_trained_as_plain_pytorch(self, world_size: int, section: str) -> None:
        leaf = SECTIONS[section]
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        data = global_batches(3, 2 * world_size)
        engine, *_ = zengine.initialize(model=model, config=_config(leaf))
        assert [zpartition.z3_leaf_module(b) for b in model.blocks] == [True, True]
        assert not zpartition.z3_leaf_module(model)
        rank = zcomm.get_rank()
        losses = []
        for tokens in data:
            loss = engine(tokens.chunk(world_size)[rank])
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG)
            losses.append(total.item())
        expected = plain_losses(reference, data, lr=LR)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
        engine.destroy()

    @pytest.mark.parametrize("world_size", [2])
    def test_what_matches_nothing_is_said(self, world_size: int) -> None:
        said: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("zengine").addHandler(handler)
        model = TinyGPT()
        try:
            engine, *_ = zengine.initialize(
                model=model, config=_config({"names": ["blocks.7"], "name_suffixes": ["nothing"]})
            )
        finally:
            logging.getLogger("zengine").removeHandler(handler)
        text = "\n".join(said)
        assert "leaf_module.names: no modules named ['blocks.7']" in text
        assert "leaf_module.name_suffixes: no module names end with ['nothing']" in text
        assert "matched no module of the model" in text
        assert zpartition.get_z3_leaf_modules(model) == []
        engine.destroy()
