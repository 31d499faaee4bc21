"""Checkpoints of the pipeline engine: each stage saves its own layers, and a resume gives
the losses of a run without a break."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

import zcomm
from zcomm.testing import DistributedTest
from zengine import CheckpointError

from .test_checkpoint_failures import file_size_limit
from .test_pipe import batches, config, initialize, pipeline, train

STEPS = 3


class TestPipelineCheckpoint(DistributedTest):
    @pytest.mark.parametrize("world_size", [2, 4])
    def test_resume_is_bit_exact(self, world_size: int, tmp_path: Path) -> None:
        stages = 2
        cfg = config(zero_optimization={"stage": 1 if world_size == 4 else 0})
        data = batches(2 * STEPS, 8 * (world_size // stages))
        engine = initialize(pipeline(stages), cfg)
        train(engine, data[:STEPS])
        folder = tmp_path / "ckpt"  # the same path on every rank (tmp_path is per test)
        engine.save_checkpoint(folder, client_state={"step": STEPS})
        straight = train(engine, data[STEPS:])
        resumed = initialize(pipeline(stages), cfg)
        path, client = resumed.load_checkpoint(folder)
        assert client == {"step": STEPS}, (path, zcomm.get_rank())
        assert train(resumed, data[STEPS:]) == straight

    @pytest.mark.parametrize("world_size", [2])
    def test_a_stage_that_fails_to_save_fails_every_stage(
        self, world_size: int, tmp_path: Path
    ) -> None:
        cfg = config(zero_optimization={"stage": 0})
        data = batches(2, 8)
        engine = initialize(pipeline(2), cfg)
        train(engine, data[:1])
        folder = tmp_path / "ckpt"
        engine.save_checkpoint(folder, tag="good")
        train(engine, data[1:])
        # stage 1's files may not grow past 4 KiB: its write fails for real (EFBIG)
        limit = file_size_limit(4096) if engine.stage_id == 1 else contextlib.nullcontext()
        with limit, pytest.raises(CheckpointError):
            engine.save_checkpoint(folder, tag="next")
        assert (folder / "latest").read_text() == "good"
        resumed = initialize(pipeline(2), cfg)
        path, _ = resumed.load_checkpoint(folder)
        assert path is not None
        assert path.endswith("good")
