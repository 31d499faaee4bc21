"""Checkpoint failures: each is named, and none leaves a bad checkpoint to be loaded as good."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zengine._checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
)

from ._helpers import (
    TinyGPT,
    checkpoint_config,
    checkpoint_engine,
    file_size_limit,
    global_batches,
    train_global,
)


def saved(tmp_path: Path, stage: int = 3) -> zengine.Engine:
    engine = checkpoint_engine(stage)
    train_global(engine, global_batches(2, 2 * zcomm.get_world_size()))
    engine.save_checkpoint(tmp_path, tag="good")
    return engine


def fingerprint(engine: zengine.Engine) -> list[torch.Tensor]:
    return [t.clone() for t in engine.optimizer.stepped_tensors()]


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter: its fp32 master, or gathered where it is frozen (no master)."""
    value = zengine.safe_get_full_fp32_param(param)
    if value is None:
        with zengine.zero.GatheredParameters([param]):
            return param.data.float().clone()  # inside: the gathered data goes on exit
    return value.clone()


class TestDamagedCheckpoint(DistributedTest):
    world_size = 2

    def test_missing_shard_is_named(self, tmp_path: Path) -> None:
        saved(tmp_path)
        zcomm.barrier()
        if zcomm.get_rank() == 0:
            (tmp_path / "good" / "__1_0.distcp").unlink()
        zcomm.barrier()
        with pytest.raises(
            CorruptCheckpointError, match=r"__1_0\.distcp is missing \(written by rank 1\)"
        ):
            checkpoint_engine(3).load_checkpoint(tmp_path)

    def test_corrupt_shard_is_named(self, tmp_path: Path) -> None:
        saved(tmp_path)
        zcomm.barrier()
        if zcomm.get_rank() == 0:
            shard = tmp_path / "good" / "__0_0.distcp"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF  # one bit pattern in the middle of a tensor
            shard.write_bytes(bytes(data))
        zcomm.barrier()
        with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp is corrupt: CRC32"):
            checkpoint_engine(3).load_checkpoint(tmp_path)

    def test_interrupted_save_is_not_loaded(self, tmp_path: Path) -> None:
        saved(tmp_path)
        zcomm.barrier()
        if zcomm.get_rank() == 0:  # what a save killed before its manifest leaves behind
            (tmp_path / "good" / "zengine.json").unlink()
        zcomm.barrier()
        with pytest.raises(CorruptCheckpointError, match=r"incomplete: zengine\.json is missing"):
            checkpoint_engine(3).load_checkpoint(tmp_path)

    def test_other_model_names_what_differs(self, tmp_path: Path) -> None:
        saved(tmp_path)
        torch.manual_seed(0)
        model = TinyGPT(blocks=3)
        engine, *_ = zengine.initialize(
            model=model, model_parameters=model.parameters(), config=checkpoint_config(3)
        )
        with pytest.raises(CheckpointMismatchError, match=r"not in the checkpoint: blocks\.2\."):
            engine.load_checkpoint(tmp_path)

    def test_not_strict_loads_what_both_have(self, tmp_path: Path) -> None:
        # load_module_strict=False (Hugging Face's Trainer passes it for PEFT models): a model
        # with a block more takes the saved weights and keeps its own extra block
        original = saved(tmp_path)
        want = {n: _full(p) for n, p in original.module.named_parameters()}
        torch.manual_seed(5)
        model = TinyGPT(blocks=3)
        engine, *_ = zengine.initialize(
            model=model, model_parameters=model.parameters(), config=checkpoint_config(3)
        )
        extra = {n: _full(p) for n, p in model.named_parameters() if n.startswith("blocks.2.")}
        assert extra
        with pytest.raises(CheckpointMismatchError, match="only with load_optimizer_states=False"):
            engine.load_checkpoint(tmp_path, load_module_strict=False)
        path, _ = engine.load_checkpoint(
            tmp_path, load_module_strict=False, load_optimizer_states=False
        )
        assert path is not None
        for n, p in model.named_parameters():
            assert torch.equal(_full(p), extra[n] if n in extra else want[n]), n
        train_global(engine, global_batches(1, 2 * zcomm.get_world_size()))  # and it trains
        # the extra block frozen: no optimizer state hangs on it, so the state loads too
        torch.manual_seed(5)
        model = TinyGPT(blocks=3)
        model.blocks[2].requires_grad_(False)
        engine, *_ = zengine.initialize(
            model=model, model_parameters=model.parameters(), config=checkpoint_config(3)
        )
        engine.load_checkpoint(tmp_path, load_module_strict=False)
        assert engine.global_steps == original.global_steps
        assert len(engine.optimizer.state) > 0
        for n, p in model.named_parameters():
            assert torch.equal(_full(p), extra[n] if n in extra else want[n]), n

    def test_other_optimizer_names_what_differs(self, tmp_path: Path) -> None:
        saved(tmp_path)
        cfg = checkpoint_config(3)
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
        torch.manual_seed(0)
        model = TinyGPT()
        engine, *_ = zengine.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        with pytest.raises(
            CheckpointMismatchError, match="optimizer: AdamW in the checkpoint, SGD now"
        ):
            engine.load_checkpoint(tmp_path)
        engine.load_checkpoint(tmp_path, load_optimizer_states=False)  # the weights alone load


class TestFailedSave(DistributedTest):
    world_size = 2

    def test_write_error_keeps_the_previous_checkpoint(self, tmp_path: Path) -> None:
        engine = saved(tmp_path)
        good = fingerprint(engine)
        train_global(engine, global_batches(1, 4))
        limit = file_size_limit(4096) if zcomm.get_rank() == 1 else contextlib.nullcontext()
        with limit, pytest.raises(CheckpointError) as failure:
            engine.save_checkpoint(tmp_path, tag="next")
        message = str(failure.value)
        assert "failed on rank 1" in message, message
        assert "File too large" in message, message
        assert (tmp_path / "latest").read_text() == "good"
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == ["good", "latest", "zero_to_fp32.py"], left
        restored = checkpoint_engine(3, seed=3)
        restored.load_checkpoint(tmp_path)
        for a, b in zip(fingerprint(restored), good, strict=True):
            assert torch.equal(a, b)

    def test_a_rank_that_never_comes_is_named(self, tmp_path: Path) -> None:
        engine = checkpoint_engine(3, checkpoint={"timeout": 1.0})
        if zcomm.get_rank() == 1:
            time.sleep(2.5)  # rank 1 "hangs" elsewhere and never calls save_checkpoint
            return
        with pytest.raises(zcomm.CommTimeoutError) as failure:
            engine.save_checkpoint(tmp_path)
        message = str(failure.value)
        assert "save_checkpoint" in message, message
        assert "Ranks 1 failed" in message, message
        assert not (tmp_path / "latest").exists()


class TestNonFiniteLoss(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
    def test_inf_loss_skips_the_step(self, precision: str) -> None:
        fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
        extra: dict[str, Any] = {"fp16": fp16} if precision == "fp16" else {}
        if precision == "bf16":
            extra = {"bf16": {"enabled": True}}
        engine = checkpoint_engine(2, **extra)
        train_global(engine, global_batches(1, 4))
        before = fingerprint(engine)
        scale = engine.optimizer.cur_scale
        loss = engine(global_batches(1, 2)[0]) * float("inf")
        engine.backward(loss)
        engine.step()
        assert engine.optimizer.skipped_steps == 1
        for a, b in zip(fingerprint(engine), before, strict=True):
            assert torch.equal(a, b)  # nothing non-finite reached the masters
        if precision == "fp16":
            assert engine.optimizer.cur_scale == scale / 2  # skip and rescale
        losses = train_global(engine, global_batches(2, 4))
        assert all(torch.isfinite(torch.tensor(losses)))

    @pytest.mark.parametrize("precision", ["bf16", "fp32"])
    def test_inf_loss_raises_when_asked(self, precision: str) -> None:
        extra: dict[str, Any] = {"nonfinite_gradients": "raise"}
        if precision == "bf16":
            extra["bf16"] = {"enabled": True}
        engine = checkpoint_engine(2, **extra)
        train_global(engine, global_batches(1, 4))
        before = fingerprint(engine)
        # only rank 1's loss is infinite: every rank must raise all the same
        factor = float("inf") if zcomm.get_rank() == 1 else 1.0
        engine.backward(engine(global_batches(1, 2)[0]) * factor)
        with pytest.raises(FloatingPointError, match=r"inf or NaN.*nonfinite_gradients"):
            engine.step()
        for a, b in zip(fingerprint(engine), before, strict=True):
            assert torch.equal(a, b)
        losses = train_global(engine, global_batches(2, 4))  # and training can go on
        assert all(torch.isfinite(torch.tensor(losses)))
