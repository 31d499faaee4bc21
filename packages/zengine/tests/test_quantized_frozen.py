"""ZeRO++'s MixZ++ through the config (``zero_quantized_nontrainable_weights``): frozen modules
kept as int8 codes, training exactly as PyTorch with their dequantized values, the memory and
``offload_states`` accounting, checkpoints and the 16-bit save, refusals."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
import zpartition
from zcomm.testing import DistributedTest

from ._helpers import LR, TinyGPT, engine_config, global_batches, plain_losses, train_engine

MIXZ = {"zero_quantized_nontrainable_weights": True}


def _config(stage: int = 3, **zero: Any) -> dict[str, Any]:
    cfg = engine_config(stage)
    cfg["zero_optimization"] |= zero
    return cfg


def _lora_like(seed: int) -> TinyGPT:
    """TinyGPT with its blocks' linear layers frozen, as LoRA's base."""
    torch.manual_seed(seed)
    model = TinyGPT()
    for name, p in model.named_parameters():
        p.requires_grad_(".up." not in name and ".down." not in name)
    return model


def _initialize(model: nn.Module, cfg: dict[str, Any]) -> zengine.Engine:
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = zengine.initialize(model=model, model_parameters=trainable, config=cfg)
    return engine


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    with zpartition.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


class TestQuantizedFrozenWeights(DistributedTest):
    world_size = 2

    def test_training_checkpoints_and_memory(self, tmp_path: Path) -> None:
        built = _lora_like(0)
        cfg = _config(stage3_gather_16bit_weights_on_model_save=True, **MIXZ)
        engine = _initialize(copy.deepcopy(built), cfg)
        plain = _initialize(copy.deepcopy(built), _config())
        assert engine.partitioned is not None
        frozen = [u for u in engine.partitioned.units if u.codes is not None]
        # a unit per block (module groups), its frozen parameters (up, down) one of their own
        assert sorted(u.name for u in frozen) == ["blocks.0", "blocks.1"]
        assert sorted(p.ds_name for u in frozen for p in u.params) == sorted(
            name  # down's bias is small enough to stay gathered (persistent)
            for i in range(2)
            for name in (f"blocks.{i}.up.weight", f"blocks.{i}.up.bias", f"blocks.{i}.down.weight")
        )

        # the frozen weights are their dequantized values from now on; the rest exact
        values = _values(engine.module)
        changed = [n for n, v in values.items() if not torch.equal(v, built.get_parameter(n))]
        assert changed
        assert all(".up." in n or ".down." in n for n in changed)

        # memory: the frozen shards are codes, a byte per fp32 element and a float32 scale per
        # block (TinyGPT's units are smaller than a block of 2048: one block each)
        held, plain_held = engine.memory_held(), plain.memory_held()
        codes: int = sum(u.codes.nbytes for u in frozen if u.codes is not None)
        exact = sum(u.shard.numel() for u in frozen)
        sizes = [u.shard.numel() // 4 for u in frozen]
        assert max(sizes) < 2048
        assert codes == sum(n + 4 for n in sizes) < 0.3 * exact
        assert held["lp_params"]["cpu"] == plain_held["lp_params"]["cpu"] - exact + codes

        # training: plain PyTorch's, on a model whose frozen weights are those values
        reference = copy.deepcopy(built)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(values[name])
        data = global_batches(4, 2 * 2)
        expected = plain_losses(reference, data, lr=LR)
        first = train_engine(engine, data[:2])
        engine.save_checkpoint(tmp_path / "ckpt")
        rest = train_engine(engine, data[2:])
        torch.testing.assert_close(first + rest, expected, rtol=1e-5, atol=0)

        # the checkpoint holds the frozen weights' values: an engine built from other weights
        # loads them (to within a rounding of re-quantizing) and trains on alike; one built
        # from the same weights keeps its codes and continues exactly
        same = _initialize(copy.deepcopy(built), _config(**MIXZ))
        same_codes = [u.codes.codes for u in same.partitioned.units if u.codes is not None]
        same.load_checkpoint(tmp_path / "ckpt")
        assert [u.codes.codes for u in same.partitioned.units if u.codes] == same_codes
        assert train_engine(same, data[2:]) == rest
        other = _initialize(_lora_like(1), _config(**MIXZ))
        other.load_checkpoint(tmp_path / "ckpt")
        loaded = _values(other.module)
        for name in changed:
            torch.testing.assert_close(loaded[name], values[name], rtol=1e-6, atol=0)
        torch.testing.assert_close(train_engine(other, data[2:]), rest, rtol=1e-5, atol=0)
        for u in other.partitioned.units:  # put away again after the load
            assert u.codes is None or u.shard.untyped_storage().nbytes() == 0

        # the 16-bit save writes the values the model computes with
        assert engine.save_16bit_model(tmp_path / "16bit")
        now = _values(engine.module)
        if zcomm.get_rank() == 0:
            saved = torch.load(tmp_path / "16bit" / "pytorch_model.bin", weights_only=True)
            for name in changed:
                assert torch.equal(saved[name], now[name]), name

        # offload_states moves the codes with the other shards, and gives them back (to
        # files: offloading host memory to the host moves nothing)
        engine.offload_states(include=["lp_params"], device="nvme", nvme_path=tmp_path / "nvme")
        assert all(u.codes.codes.data.untyped_storage().nbytes() == 0 for u in frozen)
        engine.reload_states()
        assert train_engine(engine, data[:1]) == train_engine(same, data[:1])

    def test_it_is_stage_3s(self) -> None:
        with pytest.raises(ValueError, match="zero_quantized_nontrainable_weights: ZeRO\\+\\+'s"):
            _initialize(_lora_like(0), _config(2, **MIXZ))
