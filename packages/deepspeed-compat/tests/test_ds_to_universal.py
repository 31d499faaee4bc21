"""``deepspeed.checkpoint.ds_to_universal``, as DeepSpeed's tests and users call it: a
checkpoint the engine saved becomes a universal folder, which an engine with
``checkpoint.load_universal`` loads at another ZeRO stage and continues from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import deepspeed
import zcomm
from deepspeed.checkpoint.ds_to_universal import main, parse_arguments
from unit.common import DistributedTest
from zengine import CheckpointError


def _engine(stage: int, universal: bool = False) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "checkpoint": {"load_universal": universal},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _train(engine: deepspeed.DeepSpeedEngine, steps: int) -> list[float]:
    generator = torch.Generator().manual_seed(zcomm.get_rank())
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(2, 6, generator=generator)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class TestDsToUniversal(DistributedTest):
    world_size = 2

    def test_main_then_load_universal(self, tmp_path: Path) -> None:
        saved = _engine(3)
        _train(saved, 2)
        saved.save_checkpoint(tmp_path, tag="t")
        if zcomm.get_rank() == 0:
            from deepspeed.checkpoint.ds_to_universal import main

            args = SimpleNamespace(
                input_folder=str(tmp_path / "t"),
                output_folder=str(tmp_path / "t_universal"),
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=False,
            )
            main(args)
        zcomm.barrier()
        assert (tmp_path / "latest_universal").read_text() == "t_universal"
        loaded = _engine(1, universal=True)
        path, _ = loaded.load_checkpoint(tmp_path)
        assert path == str(tmp_path / "t_universal")
        assert loaded.global_steps == 2
        assert _train(loaded, 2) == _train(saved, 2)


class TestCommand(DistributedTest):
    world_size = 1

    def test_python_m(self, tmp_path: Path) -> None:
        """``python -m deepspeed.checkpoint.ds_to_universal`` writes the folder; a missing one
        fails, and a folder of DeepSpeed's own is refused with the reason (zstack loads it as
        it is)."""
        engine = _engine(2)
        _train(engine, 1)
        engine.save_checkpoint(tmp_path / "run", tag="t")

        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        command += ["--input_folder", str(tmp_path / "run" / "t")]
        command += ["--output_folder", str(tmp_path / "u")]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "u" / "zero" / "optimizer_state.pt").is_file()
        assert (tmp_path / "latest_universal").read_text() == "u"

        def convert(source: Path) -> None:  # the module's command line, in this process
            main(parse_arguments(["--input_folder", str(source), "--output_folder", "u2"]))

        with pytest.raises(CheckpointError, match="no checkpoint here"):
            convert(tmp_path / "none")
        (tmp_path / "ds").mkdir()
        (tmp_path / "ds" / "mp_rank_00_model_states.pt").write_bytes(b"")
        with pytest.raises(SystemExit, match="zstack loads it as it is"):
            convert(tmp_path / "ds")
