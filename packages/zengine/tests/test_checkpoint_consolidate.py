"""Consolidation (``zengine consolidate``) and ``save_16bit_model``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zengine._consolidate import consolidate, fp32_state_dict
from zengine._safetensors import read_safetensors

from ._models import global_batches
from .test_checkpoint import engine_for, train_global


def full_model(engine: zengine.Engine) -> dict[str, torch.Tensor]:
    """The fp32 masters, gathered (every rank must call it)."""
    out = {}
    for name, p in engine.module.named_parameters():
        value = zengine.safe_get_full_fp32_param(p)
        assert value is not None
        out[name] = value.clone()
    return out


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], value), name


class TestConsolidate(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [1, 3])
    def test_consolidated_is_the_full_fp32_model(self, stage: int, tmp_path: Path) -> None:
        engine = engine_for(stage, bf16={"enabled": True})
        train_global(engine, global_batches(2, 4))
        engine.save_checkpoint(tmp_path / "ckpt")
        expected = full_model(engine)
        if zcomm.get_rank() != 0:
            return
        assert_same(fp32_state_dict(tmp_path / "ckpt"), expected)
        budget = 4096  # bytes: many small batches, some parameters larger than the budget
        out = consolidate(tmp_path / "ckpt", tmp_path / "model.pt", budget=budget)
        assert_same(torch.load(out, weights_only=True), expected)
        out = consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors", budget=budget)
        assert_same(read_safetensors(out), expected)

    def test_command_line(self, tmp_path: Path) -> None:
        engine = engine_for(3)
        train_global(engine, global_batches(1, 4))
        engine.save_checkpoint(tmp_path / "ckpt", tag="t1")
        expected = full_model(engine)
        if zcomm.get_rank() != 0:
            return
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "zengine",
                "consolidate",
                str(tmp_path / "ckpt"),
                str(tmp_path / "m.pt"),
            ],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert_same(torch.load(tmp_path / "m.pt", weights_only=True), expected)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "zengine",
                "consolidate",
                str(tmp_path),
                str(tmp_path / "x.pt"),
                "--tag",
                "nope",
            ],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=120,
        )
        assert done.returncode == 1, done.stderr
        assert "nope does not exist" in done.stderr, done.stderr


class TestSave16bit(DistributedTest):
    world_size = 2

    def test_stage3_gathers_when_asked(self, tmp_path: Path) -> None:
        zero = {
            "stage": 3,
            "stage3_param_persistence_threshold": 16,
            "stage3_gather_16bit_weights_on_model_save": True,
        }
        engine = engine_for(3, bf16={"enabled": True}, zero_optimization=zero)
        train_global(engine, global_batches(1, 4))
        assert engine.save_16bit_model(tmp_path, "model.safetensors")
        assert engine.save_16bit_model(tmp_path)
        assert engine.save_fp16_model(tmp_path, "old_name.bin")  # DeepSpeed's older name
        expected = {k: v.to(torch.bfloat16) for k, v in full_model(engine).items()}
        if zcomm.get_rank() == 0:
            for state in (
                read_safetensors(tmp_path / "model.safetensors"),
                torch.load(tmp_path / "pytorch_model.bin", weights_only=True),
            ):
                assert list(state) == list(expected)
                for name, value in expected.items():
                    assert state[name].dtype == torch.bfloat16
                    assert torch.equal(state[name], value)
        # what Hugging Face Accelerate asks a ZeRO-3 engine for
        assert engine.zero_gather_16bit_weights_on_model_save()
        state = engine._zero3_consolidated_16bit_state_dict()
        if zcomm.get_rank() == 0:
            assert list(state) == list(expected)
            assert all(torch.equal(state[k], v) for k, v in expected.items())
        else:
            assert state == {}

    def test_stage3_without_the_switch_saves_nothing(self, tmp_path: Path) -> None:
        engine = engine_for(3)
        assert not engine.zero_gather_16bit_weights_on_model_save()
        assert engine.save_16bit_model(tmp_path) is False
        assert not (tmp_path / "pytorch_model.bin").exists()
