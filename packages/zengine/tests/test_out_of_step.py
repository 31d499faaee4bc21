"""Ranks out of step at ZeRO-3 (one steps while another runs a forward; one skips a backward)
fail at once on every rank, naming each rank's engine call and step, instead of hanging."""

from __future__ import annotations

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zpartition import ZeroParamError

from ._helpers import TinyGPT, global_batches

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _one_step(engine: zengine.Engine, tokens: torch.Tensor) -> None:
    engine.backward(engine(tokens))
    engine.step()


class TestOutOfStep(DistributedTest):
    @pytest.mark.parametrize("world_size", [2, 4])
    def test_a_step_against_a_forward(self, world_size: int) -> None:
        engine, *_ = zengine.initialize(model=TinyGPT(), config=CONFIG)
        tokens = global_batches(1, 2)[0]
        _one_step(engine, tokens)
        rank = zcomm.get_rank()
        with pytest.raises(ZeroParamError) as info:
            engine.step() if rank == 0 else engine(tokens)  # rank 0 steps once too often
        zcomm.set_activity(zcomm.CALLS[0], 0)  # the ranks' calls differ: not for the next test
        message = str(info.value)
        assert "ranks are out of step" in message
        assert f"rank 0{' (this rank)' if rank == 0 else ''}: in step, step 1: step" in message
        for other in range(1, world_size):
            mark = " (this rank)" if rank == other else ""
            assert f"rank {other}{mark}: in forward, step 1: gather" in message

    @pytest.mark.parametrize("world_size", [2])
    def test_a_skipped_backward(self, world_size: int) -> None:
        engine, *_ = zengine.initialize(model=TinyGPT(), config=CONFIG)
        tokens = global_batches(1, 2)[0]
        _one_step(engine, tokens)
        loss = engine(tokens)
        rank = zcomm.get_rank()
        with pytest.raises(ZeroParamError) as info:
            engine.backward(loss) if rank == 0 else engine.step()  # rank 1 skips its backward
        zcomm.set_activity(zcomm.CALLS[0], 0)
        message = str(info.value)
        assert "ranks are out of step" in message
        assert f"rank 0{' (this rank)' if rank == 0 else ''}: in backward, step 1: " in message
        assert f"rank 1{' (this rank)' if rank == 1 else ''}: in step, step 1: step" in message
