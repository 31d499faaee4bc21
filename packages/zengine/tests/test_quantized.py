"""ZeRO++ quantized communication through the config (``zero_quantized_weights``,
``zero_quantized_gradients``): training close to plain PyTorch and not equal to the exact run,
what is saved exact, refusals."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest

from ._helpers import LR, TinyGPT, engine_config, global_batches, plain_losses, train_engine


def _config(stage: int = 3, **zero: Any) -> dict[str, Any]:
    cfg = engine_config(stage)
    cfg["zero_optimization"] |= zero
    return cfg


class TestQuantizedCommunication(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("keys", [("weights",), ("weights", "gradients")])
    def test_training_follows_plain_pytorch_and_the_saved_weights_are_exact(
        self, tmp_path: Path, keys: tuple[str, ...]
    ) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        reference, exact = copy.deepcopy(model), copy.deepcopy(model)
        data = global_batches(4, 2 * 2)
        quantized = {f"zero_quantized_{key}": True for key in keys}
        cfg = _config(stage3_gather_16bit_weights_on_model_save=True, **quantized)
        engine, *_ = zengine.initialize(model=model, config=cfg)
        losses = train_engine(engine, data)
        other, *_ = zengine.initialize(model=exact, config=_config())
        unquantized = train_engine(other, data)
        expected = plain_losses(reference, data, lr=LR)
        # int8 blocks of 2048: weights and gradients each within half a scale
        torch.testing.assert_close(losses, expected, rtol=1e-2, atol=0)
        assert losses != unquantized  # the gathers were quantized
        torch.testing.assert_close(unquantized, expected, rtol=1e-5, atol=0)
        # what is saved is the shards, exact: the 16-bit save equals the fp32 masters
        assert engine.save_16bit_model(tmp_path)  # pytorch_model.bin
        masters = {n: zengine.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
        if zcomm.get_rank() == 0:
            saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
            for name, master in masters.items():
                assert master is not None
                assert torch.equal(saved[name], master), name

    def test_it_is_stage_3s(self) -> None:
        for key in ("weights", "gradients"):
            with pytest.raises(ValueError, match=f"zero_quantized_{key}: ZeRO\\+\\+'s q"):
                zengine.initialize(
                    model=TinyGPT(), config=_config(2, **{f"zero_quantized_{key}": True})
                )
