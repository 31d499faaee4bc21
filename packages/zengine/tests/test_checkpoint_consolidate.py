"""Consolidation (``zengine consolidate``) and ``save_16bit_model``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zcomm
import zengine
import zpartition
from zcomm.testing import DistributedTest
from zengine._checkpoint import consolidate, fp32_state_dict, read_safetensors
from zengine.utils.zero_to_fp32 import (
    LazyTensor,
    _bytes,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

from ._helpers import (
    HIDDEN,
    TinyGPT,
    checkpoint_config,
    checkpoint_engine,
    global_batches,
    train_global,
)


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
        engine = checkpoint_engine(stage, bf16={"enabled": True})
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
        engine = checkpoint_engine(3)
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
        engine = checkpoint_engine(3, bf16={"enabled": True}, zero_optimization=zero)
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
        engine = checkpoint_engine(3)
        assert not engine.zero_gather_16bit_weights_on_model_save()
        assert engine.save_16bit_model(tmp_path) is False
        assert not (tmp_path / "pytorch_model.bin").exists()


def tied_engine(stage: int) -> zengine.Engine:
    """TinyGPT with its head tied to its embedding (as language models tie them) and one frozen
    LayerNorm."""
    torch.manual_seed(0)
    model = TinyGPT()
    model.head.weight = model.embed.weight
    model.blocks[0].norm.requires_grad_(False)
    zero = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}
    engine, *_ = zengine.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=checkpoint_config(stage, zero_optimization=zero),
    )
    return engine


def every_name(engine: zengine.Engine) -> dict[str, torch.Tensor]:
    """The fp32 masters, and the weights of the frozen parameters (which have none), under
    every name of each parameter (every rank must call it)."""
    first: dict[int, torch.Tensor] = {}
    out = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) not in first:
            value = zengine.safe_get_full_fp32_param(p)
            if value is None:  # frozen
                with zpartition.GatheredParameters([p]):
                    value = p.data.float()
            first[id(p)] = value.clone()
        out[name] = first[id(p)]
    return out


class TestZeroToFp32(DistributedTest):
    """DeepSpeed's ``deepspeed.utils.zero_to_fp32`` functions, and tied weights under every
    name, as DeepSpeed's consolidation gives them."""

    world_size = 2

    @pytest.mark.parametrize("stage", [1, 3])
    def test_tied_and_frozen_parameters(self, stage: int, tmp_path: Path) -> None:
        engine = tied_engine(stage)
        train_global(engine, global_batches(2, 4))
        engine.save_checkpoint(tmp_path / "ckpt")
        expected = every_name(engine)
        state16 = engine._zero3_consolidated_16bit_state_dict()
        assert engine.save_16bit_model(tmp_path, "model16.safetensors")
        if zcomm.get_rank() != 0:
            return
        assert state16.keys() == expected.keys()
        assert state16["head.weight"] is state16["embed.weight"]  # one tensor, as DeepSpeed's
        assert "head.weight" not in read_safetensors(tmp_path / "model16.safetensors")

        state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[k], v) for k, v in expected.items())  # type: ignore[arg-type]
        assert state["head.weight"] is state["embed.weight"]
        TinyGPT().load_state_dict(state)  # strict: every name of the model is there
        trained = get_fp32_state_dict_from_zero_checkpoint(
            tmp_path / "ckpt", tag="global_step2", exclude_frozen_parameters=True
        )
        assert trained.keys() == {k for k in expected if not k.startswith("blocks.0.norm.")}
        lazy = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", lazy_mode=True)
        assert lazy.keys() == expected.keys()
        for name, value in lazy.items():
            assert isinstance(value, LazyTensor)
            assert value.shape == expected[name].shape
            assert torch.equal(value.contiguous(), expected[name])

        saved = torch.load(consolidate(tmp_path / "ckpt", tmp_path / "m.pt"), weights_only=True)
        assert saved.keys() == expected.keys()
        assert saved["head.weight"].data_ptr() == saved["embed.weight"].data_ptr()  # one storage
        flat = read_safetensors(consolidate(tmp_path / "ckpt", tmp_path / "m.safetensors"))
        assert flat.keys() == expected.keys() - {"head.weight"}  # safetensors cannot share

        model = load_state_dict_from_zero_checkpoint(TinyGPT(), tmp_path / "ckpt")
        assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())

    def test_convert_writes_hugging_face_shards(self, tmp_path: Path) -> None:
        engine = tied_engine(3)
        train_global(engine, global_batches(1, 4))
        engine.save_checkpoint(tmp_path / "ckpt")
        expected = every_name(engine)
        if zcomm.get_rank() != 0:
            return
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "one")
        assert os.listdir(tmp_path / "one") == ["pytorch_model.bin"]  # under the 5GB default
        one = torch.load(tmp_path / "one" / "pytorch_model.bin", weights_only=True)
        assert one.keys() == expected.keys()

        limit = 4 * HIDDEN * HIDDEN * 4  # bytes: one up-projection weight, fp32
        for safe in (False, True):
            out = tmp_path / f"shards-{safe}"
            convert_zero_checkpoint_to_fp32_state_dict(
                tmp_path / "ckpt", out, max_shard_size=limit, safe_serialization=safe
            )
            stem, suffix = ("model", ".safetensors") if safe else ("pytorch_model", ".bin")
            index = json.loads((out / f"{stem}{suffix}.index.json").read_text())
            shards = sorted(set(index["weight_map"].values()))
            assert len(shards) > 2
            assert shards[0] == f"{stem}-00001-of-{len(shards):05d}{suffix}"
            assert sorted(os.listdir(out)) == sorted([*shards, f"{stem}{suffix}.index.json"])
            got: dict[str, torch.Tensor] = {}
            for shard in shards:
                part = (
                    read_safetensors(out / shard)
                    if safe
                    else torch.load(out / shard, weights_only=True)
                )
                assert all(index["weight_map"][k] == shard for k in part)
                nbytes = sum(v.nbytes for k, v in part.items() if k != "head.weight")
                assert nbytes <= limit or len(part) == 1  # one larger tensor alone
                got.update(part)
            names = expected.keys() - ({"head.weight"} if safe else set())
            assert got.keys() == names == index["weight_map"].keys()
            assert all(torch.equal(got[k], expected[k]) for k in names)
            unique = sum(v.nbytes for k, v in expected.items() if k != "head.weight")
            assert index["metadata"]["total_size"] == unique


def test_shard_sizes_are_read_as_hugging_face_writes_them() -> None:
    assert _bytes("5GB") == 5 * 10**9
    assert _bytes("500MiB") == 500 * 2**20
    assert _bytes("1.5 kb") == 1500
    assert _bytes(4096) == 4096
    for bad in ("5 parsecs", "0GB", 0, -1, True):
        with pytest.raises(ValueError, match="max_shard_size: expected a positive number"):
            _bytes(bad)
