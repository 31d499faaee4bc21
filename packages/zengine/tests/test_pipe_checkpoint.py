"""Checkpoints of the pipeline engine: each stage saves its own layers, and a resume gives
the losses of a run without a break."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

import zcomm
from zcomm.testing import DistributedTest
from zengine import CheckpointError

from ._helpers import (
    file_size_limit,
    global_batches,
    pipe_config,
    pipe_initialize,
    pipe_train,
    pipeline,
)

STEPS = 3


class TestPipelineCheckpoint(DistributedTest):
    @pytest.mark.parametrize("world_size", [2, 4])
    def test_resume_is_bit_exact(self, world_size: int, tmp_path: Path) -> None:
        stages = 2
        cfg = pipe_config(zero_optimization={"stage": 1 if world_size == 4 else 0})
        data = global_batches(2 * STEPS, 8 * (world_size // stages))
        engine = pipe_initialize(pipeline(stages), cfg)
        pipe_train(engine, data[:STEPS])
        folder = tmp_path / "ckpt"  # the same path on every rank (tmp_path is per test)
        engine.save_checkpoint(folder, client_state={"step": STEPS})
        straight = pipe_train(engine, data[STEPS:])
        resumed = pipe_initialize(pipeline(stages), cfg)
        path, client = resumed.load_checkpoint(folder)
        assert client == {"step": STEPS}, (path, zcomm.get_rank())
        assert pipe_train(resumed, data[STEPS:]) == straight

    @pytest.mark.parametrize("world_size", [2])
    def test_a_stage_that_fails_to_save_fails_every_stage(
        self, world_size: int, tmp_path: Path
    ) -> None:
        cfg = pipe_config(zero_optimization={"stage": 0})
        data = global_batches(2, 8)
        engine = pipe_initialize(pipeline(2), cfg)
        pipe_train(engine, data[:1])
        folder = tmp_path / "ckpt"
        engine.save_checkpoint(folder, tag="good")
        pipe_train(engine, data[1:])
        # stage 1's files may not grow past 4 KiB: its write fails for real (EFBIG)
        limit = file_size_limit(4096) if engine.stage_id == 1 else contextlib.nullcontext()
        with limit, pytest.raises(CheckpointError):
            engine.save_checkpoint(folder, tag="next")
        assert (folder / "latest").read_text() == "good"
        resumed = pipe_initialize(pipeline(2), cfg)
        path, _ = resumed.load_checkpoint(folder)
        assert path is not None
        assert path.endswith("good")
