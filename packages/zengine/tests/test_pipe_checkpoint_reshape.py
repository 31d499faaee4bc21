"""Pipeline checkpoints loaded into another number of stages, another partition of the same
layers or another data-parallel size: the losses after the load are those of the run that
never stopped. A checkpoint of other layers, or with a stage missing, loads nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
from zcomm.testing import DistributedTest
from zengine import CheckpointError
from zengine._checkpoint import CheckpointMismatchError, CorruptCheckpointError
from zengine.pipe import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec

from ._helpers import (
    BASE_SEED,
    HIDDEN,
    LR,
    VOCAB,
    Block,
    global_batches,
    head,
    loss_fn,
    pipe_config,
    pipe_initialize,
    pipe_train,
    pipeline,
    tied_weights_equal,
)

STEPS = 3
ROWS = 16  # tokens rows per global batch, whatever the data-parallel size
OTHER_PARTITION = [0, 2, 7]  # "parameters" splits the 7 layers in 2 as [0, 3, 7]


def cfg(data_parallel: int, **extra: Any) -> dict[str, Any]:
    """The same global batch (4 micro-batches of 4 rows) at any data-parallel size, with a
    warm-up schedule (its position must be restored for the losses to match)."""
    schedule = {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 10}
    return pipe_config(
        micro=4 // data_parallel,
        accumulation=4,
        scheduler={"type": "WarmupLR", "params": schedule},
        **extra,
    )


def resumed(module: PipelineModule, data_parallel: int, folder: Path, tag: str) -> PipelineEngine:
    engine = pipe_initialize(module, cfg(data_parallel, zero_optimization={"stage": 1}))
    path, client = engine.load_checkpoint(folder, tag=tag)
    assert path is not None
    assert client == {"step": STEPS}
    assert engine.global_steps == STEPS
    assert tied_weights_equal(module)
    return engine


def expect(losses: list[float], reference: list[float]) -> None:
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)


def state_of(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def unchanged(engine: PipelineEngine, before: dict[str, torch.Tensor]) -> bool:
    now = state_of(engine)
    return engine.global_steps == 0 and all(torch.equal(now[n], t) for n, t in before.items())


class TestReshapedLoad(DistributedTest):
    @pytest.mark.world_size([4, 2])  # one after the other, sharing tmp_path
    def test_other_stages_partitions_and_replicas(self, tmp_path: Path) -> None:
        """At 4 ranks a 2x2 run (pipe x data, ZeRO 1) saves after 3 steps and trains on (the
        reference); its checkpoint loads into 4x1 (2 -> 4 stages), which saves at once. At 2
        ranks: 4 -> 2 stages, 2x2 -> 2x1, 2 stages -> 1 (x2 data), another partition."""
        folder = tmp_path / "ckpt"
        data = global_batches(2 * STEPS, ROWS)
        reference_file = tmp_path / "reference.json"
        if zcomm.get_world_size() == 4:
            engine = pipe_initialize(pipeline(2), cfg(2, zero_optimization={"stage": 1}))
            pipe_train(engine, data[:STEPS])
            engine.save_checkpoint(folder, tag="two", client_state={"step": STEPS})
            reference = pipe_train(engine, data[STEPS:])
            if zcomm.get_rank() == 0:
                reference_file.write_text(json.dumps(reference))
            four = resumed(pipeline(4), 1, folder, "two")
            four.save_checkpoint(folder, tag="four", client_state={"step": STEPS})
            expect(pipe_train(four, data[STEPS:]), reference)
            return
        reference = json.loads(reference_file.read_text())
        cases = [
            (pipeline(2), 1, "four"),
            (pipeline(2), 1, "two"),  # the same stages: each loads its own directory
            (pipeline(1), 2, "two"),
            (pipeline(2, partition_method=OTHER_PARTITION), 1, "two"),
        ]
        for module, data_parallel, tag in cases:
            engine = resumed(module, data_parallel, folder, tag)
            expect(pipe_train(engine, data[STEPS:]), reference)

    @pytest.mark.parametrize("world_size", [2])
    def test_fp16_two_stages_to_one(self, world_size: int, tmp_path: Path) -> None:
        """The loss scale and the fp32 masters of fp16 training move to another stage count."""
        folder = tmp_path / "ckpt"
        data = global_batches(2 * STEPS, ROWS)
        fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}}
        engine = pipe_initialize(pipeline(2), cfg(1, **fp16))
        pipe_train(engine, data[:STEPS])
        engine.save_checkpoint(folder, client_state={"step": STEPS})
        scale = engine.optimizer.cur_scale
        reference = pipe_train(engine, data[STEPS:])
        one = pipe_initialize(pipeline(1), cfg(2, **fp16))
        _, client = one.load_checkpoint(folder)
        assert client == {"step": STEPS}
        assert one.optimizer.cur_scale == scale
        loaded = state_of(one)
        torch.testing.assert_close(pipe_train(one, data[STEPS:]), reference, rtol=1e-3, atol=0)
        # the weights alone, without the optimizer's state
        weights = pipe_initialize(pipeline(1), cfg(2, **fp16))
        weights.load_checkpoint(folder, load_optimizer_states=False)
        assert all(torch.equal(p, loaded[n]) for n, p in state_of(weights).items())
        assert weights.optimizer.optimizer.state == {}

    @pytest.mark.parametrize("world_size", [2])
    def test_interleaved_bf16_into_other_chunks(self, world_size: int, tmp_path: Path) -> None:
        """bf16 training with 2 chunks per stage (interleaved 1F1B: each stage holds two
        non-adjacent runs of layers) loads into 1 chunk per stage, and into 1 stage x 2."""
        folder = tmp_path / "ckpt"
        data = global_batches(2 * STEPS, ROWS)
        bf16 = {"bf16": {"enabled": True}}
        interleaved = {"pipeline": {"schedule": "interleaved"}, **bf16}
        engine = pipe_initialize(pipeline(2, chunks=2), cfg(1, **interleaved))
        pipe_train(engine, data[:STEPS])
        engine.save_checkpoint(folder, client_state={"step": STEPS})
        reference = pipe_train(engine, data[STEPS:])
        for module, data_parallel in [(pipeline(2), 1), (pipeline(1), 2)]:
            other = pipe_initialize(module, cfg(data_parallel, **bf16))
            _, client = other.load_checkpoint(folder)
            assert client == {"step": STEPS}
            assert other.global_steps == STEPS
            assert tied_weights_equal(module)
            got = pipe_train(other, data[STEPS:])
            # the same weights: the first loss (before any update) is the reference's; after
            # it, bf16 gradients summed in another order (across replicas) differ a little
            torch.testing.assert_close(got[0], reference[0], rtol=1e-5, atol=0)
            torch.testing.assert_close(got, reference, rtol=1e-3, atol=0)


def _wider_embedding() -> list[Any]:
    """The test model's 7 layers, but for one more token in the tied embedding."""
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB + 1, HIDDEN),
        *[LayerSpec(Block) for _ in range(4)],
        LayerSpec(nn.LayerNorm, HIDDEN),
        TiedLayerSpec("embed", nn.Embedding, VOCAB + 1, HIDDEN, forward_fn=head),
    ]


class TestReshapedLoadErrors(DistributedTest):
    world_size = 2

    def test_other_layers_and_a_missing_stage(self, tmp_path: Path) -> None:
        folder = tmp_path / "ckpt"
        engine = pipe_initialize(pipeline(2), cfg(1))
        pipe_train(engine, global_batches(1, ROWS))
        engine.save_checkpoint(folder, tag="t", client_state={"step": 1})

        # another model: a block fewer, so every later layer moves down one index
        fewer = pipe_initialize(pipeline(2, blocks=3), cfg(1))
        before = state_of(fewer)
        with pytest.raises(CheckpointMismatchError) as error:
            fewer.load_checkpoint(folder, tag="t")
        message = str(error.value)
        assert "nothing was loaded" in message
        assert "layers: 7 in the checkpoint, 6 in the model" in message
        assert "4.up.weight (layer 4)" in message
        assert "parameters in the model but not in the checkpoint: 4.bias (layer 4)" in message
        assert unchanged(fewer, before)

        # the same layers but a wider tied embedding, into one stage
        module = PipelineModule(
            _wider_embedding(), num_stages=1, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED
        )
        wider = pipe_initialize(module, cfg(2))
        before = state_of(wider)
        with pytest.raises(CheckpointMismatchError) as error:
            wider.load_checkpoint(folder, tag="t")
        shape = "tied_modules.embed.weight (tied 'embed', layers 0, 6) (32, 16) vs (33, 16)"
        assert shape in str(error.value)
        assert unchanged(wider, before)

        # a stage directory gone: named, whether the stages change or not
        zcomm.barrier()
        if zcomm.get_rank() == 0:
            shutil.rmtree(folder / "stage1" / "t")
        zcomm.barrier()
        for stages in (1, 2):
            other = pipe_initialize(pipeline(stages), cfg(2 // stages))
            before = state_of(other)
            with pytest.raises(CorruptCheckpointError, match=r"stage1/t does not exist"):
                other.load_checkpoint(folder, tag="t")
            assert unchanged(other, before)

    def test_a_stage_that_fails_to_load_fails_every_stage(self, tmp_path: Path) -> None:
        folder = tmp_path / "ckpt"
        engine = pipe_initialize(pipeline(2), cfg(1))
        pipe_train(engine, global_batches(1, ROWS))  # a load would change the weights and the step
        engine.save_checkpoint(folder, tag="t")
        assert json.loads((folder / "pipeline-t.json").read_text())["stages"] == 2
        zcomm.barrier()
        if zcomm.get_rank() == 0:  # damage one file of stage 1
            victim = next((folder / "stage1" / "t").glob("*.distcp"))
            data = bytearray(victim.read_bytes())
            data[-1] ^= 0xFF
            victim.write_bytes(bytes(data))
        zcomm.barrier()
        for parts in (OTHER_PARTITION, "parameters"):  # a reshaped load, then the same stages
            one = pipe_initialize(pipeline(2, partition_method=parts), cfg(1))
            before = state_of(one)
            # stage 1 reads the damaged file; stage 0 (layers 0-1, from stage0/t) is told
            if one.stage_id == 1:
                with pytest.raises(CorruptCheckpointError, match="is corrupt: CRC32"):
                    one.load_checkpoint(folder, tag="t")
            else:
                with pytest.raises(CheckpointError, match=r"stage\(s\) \[1\] found damaged"):
                    one.load_checkpoint(folder, tag="t")
            assert unchanged(one, before)  # on every stage: nothing was read
