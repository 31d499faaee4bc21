"""Activation checkpointing in a pipeline, as DeepSpeed's: ``pipeline.use_reentrant``, the
module's checkpoint interval and its setter, and ``zengine.checkpointing.configure`` taking the
engine's config, a dict or a path; each run against the same model trained in one process."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zengine import _recompute, checkpointing
from zengine.pipe import LayerSpec, PipelineEngine, PipelineModule

from ._helpers import (
    BASE_SEED,
    LR,
    Block,
    global_batches,
    pipe_config,
    pipe_initialize,
    pipe_reference_losses,
    pipe_train,
    pipeline,
)

STEPS = 3
MICRO_BATCHES = 4  # pipe_config()'s gradient_accumulation_steps


def _counting_blocks(module: PipelineModule) -> list[int]:
    """One counter per Block on this stage, raised each time its forward starts (a
    recomputation in backward too)."""
    counts: list[int] = []
    for layer in module.modules():
        if isinstance(layer, Block):
            counts.append(0)
            index = len(counts) - 1

            def count(*_: Any, at: int = index) -> None:
                counts[at] += 1

            layer.register_forward_pre_hook(count)
    return counts


def _trains_as_the_plain_model(engine: PipelineEngine) -> None:
    data = global_batches(STEPS, 8)
    expected, _ = pipe_reference_losses(data)
    torch.testing.assert_close(pipe_train(engine, data), expected, rtol=1e-5, atol=0)


class TestUseReentrant(DistributedTest):
    world_size = (1, 2, 4)

    @pytest.mark.parametrize("use_reentrant", [True, False])
    def test_trains_as_the_plain_model(self, use_reentrant: bool) -> None:
        # the first segment is the embedding, fed token ids: a reentrant checkpoint of it would
        # leave its weight without a gradient; stage 0 runs it as a non-reentrant one instead
        module = pipeline(zcomm.get_world_size())
        cfg = {"activation_checkpoint_interval": 1, "use_reentrant": use_reentrant}
        engine = pipe_initialize(module, pipe_config(pipeline=cfg))
        function = module.activation_checkpoint_func
        if use_reentrant:
            assert function is checkpointing.reentrant_checkpoint
        else:
            assert function is checkpointing.non_reentrant_checkpoint
        assert engine._reentrant_activation_checkpointing() is use_reentrant
        counts = _counting_blocks(module)
        _trains_as_the_plain_model(engine)
        # every block ran twice per micro-batch: its forward, and again in backward
        assert counts == [2 * MICRO_BATCHES * STEPS] * len(counts)

    def test_unset_is_reentrant(self) -> None:
        # DeepSpeed's default
        module = pipeline(zcomm.get_world_size())
        engine = pipe_initialize(
            module, pipe_config(pipeline={"activation_checkpoint_interval": 2})
        )
        assert module.activation_checkpoint_func is checkpointing.reentrant_checkpoint
        assert engine._reentrant_activation_checkpointing()
        _trains_as_the_plain_model(engine)


class Recorder(nn.Linear):
    """A linear layer that records whether its inputs require grad."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.requires_grad)
        return super().forward(x)


def _float_layers(width: int) -> list[Any]:
    return [
        LayerSpec(Recorder, width),
        nn.Tanh(),
        LayerSpec(nn.Linear, width, width),
        nn.Tanh(),
        LayerSpec(nn.Linear, width, 1),
    ]


def _float_reference(width: int, data: list[torch.Tensor]) -> list[float]:
    """The float model in one process, built with the pipeline's per-layer seeds."""
    layers = []
    for index, layer in enumerate(_float_layers(width)):
        torch.manual_seed(BASE_SEED + index)
        layers.append(layer.build() if isinstance(layer, LayerSpec) else layer)
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for batch in data:
        loss = nn.functional.mse_loss(model(batch[:, :width]), batch[:, width:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _float_micro_batches(batch: torch.Tensor, width: int) -> Iterator[Any]:
    return iter([(b[:, :width], b[:, width:]) for b in batch.chunk(MICRO_BATCHES)])


class TestFirstStageInputs(DistributedTest):
    world_size = (1, 2)

    @pytest.mark.parametrize("use_reentrant", [True, False])
    def test_require_grad_under_reentrant_checkpointing(self, use_reentrant: bool) -> None:
        # DeepSpeed's rule: float inputs of the first stage require grad when the module
        # checkpoints reentrantly (a detached copy: the caller's tensors stay as they were)
        width = 8
        module = PipelineModule(
            _float_layers(width),
            num_stages=zcomm.get_world_size(),
            loss_fn=nn.functional.mse_loss,
            seed_layers=True,
            base_seed=BASE_SEED,
            partition_method="uniform",
            activation_checkpoint_interval=2,
        )
        cfg = pipe_config(pipeline={"use_reentrant": use_reentrant})
        engine = pipe_initialize(module, cfg)
        g = torch.Generator().manual_seed(3)
        data = [torch.randn(8, width + 1, generator=g) for _ in range(STEPS)]
        losses = [engine.train_batch(_float_micro_batches(b, width)).item() for b in data]
        torch.testing.assert_close(losses, _float_reference(width, data), rtol=1e-5, atol=0)
        assert all(not b.requires_grad for b in data)
        if engine.is_first_stage():
            recorder = next(m for m in module.modules() if isinstance(m, Recorder))
            assert set(recorder.seen) == {use_reentrant}


class TestZeroBubble(DistributedTest):
    world_size = 2

    def test_unset_is_non_reentrant_and_true_is_refused(self) -> None:
        # the split backward asks autograd.grad for the input gradients, which torch's
        # reentrant checkpoint refuses
        module = pipeline(2)
        cfg = {"activation_checkpoint_interval": 1, "schedule": "zero_bubble"}
        engine = pipe_initialize(module, pipe_config(pipeline=cfg))
        assert module.activation_checkpoint_func is checkpointing.non_reentrant_checkpoint
        _trains_as_the_plain_model(engine)
        with pytest.raises(zengine.ConfigError, match="use_reentrant: true with schedule"):
            pipe_initialize(pipeline(2), pipe_config(pipeline={**cfg, "use_reentrant": True}))


class TestCheckpointInterval(DistributedTest):
    world_size = (1, 2)

    def test_the_setter_rebuilds_the_segments(self) -> None:
        # DeepSpeed's test: parameter-free layers first, so blocks differ
        def layers() -> list[Any]:
            return [*[nn.ReLU() for _ in range(4)], *[LayerSpec(nn.Linear, 4, 4) for _ in range(4)]]

        stages = zcomm.get_world_size()
        module = PipelineModule(layers(), num_stages=stages, partition_method="uniform")
        assert module.is_checkpointable_results == []
        module.set_checkpoint_interval(4)
        # one stage: ReLUs | Linears; two: the ReLUs on stage 0, the Linears on stage 1
        expected = [False, True] if stages == 1 else [module.stage_id == 1]
        assert module.is_checkpointable_results == expected
        module.set_checkpoint_interval(1)
        reference = PipelineModule(
            layers(),
            num_stages=stages,
            partition_method="uniform",
            activation_checkpoint_interval=1,
        )
        reference._precompute_checkpointable_values()
        assert module.activation_checkpoint_interval == 1
        assert module.is_checkpointable_results == reference.is_checkpointable_results
        assert len(module.is_checkpointable_results) == 8 // stages
        with pytest.raises(ValueError, match="activation_checkpoint_interval=-1"):
            module.set_checkpoint_interval(-1)
        named = PipelineModule(
            layers(),
            num_stages=stages,
            partition_method="uniform",
            activation_checkpoint_interval=2,
            checkpointable_layers=["ReLU"],
        )
        named._precompute_checkpointable_values()
        relus = [True, True] if stages == 1 or module.stage_id == 0 else []
        linears = [False, False] if stages == 1 or module.stage_id == 1 else []
        assert named.is_checkpointable_results == relus + linears

    def test_the_setter_turns_checkpointing_on_and_off(self) -> None:
        module = pipeline(zcomm.get_world_size())
        engine = pipe_initialize(module, pipe_config())
        assert not engine._reentrant_activation_checkpointing()
        counts = _counting_blocks(module)
        module.set_checkpoint_interval(2)
        assert engine._reentrant_activation_checkpointing()
        _trains_as_the_plain_model(engine)
        assert counts == [2 * MICRO_BATCHES * STEPS] * len(counts)
        module.set_checkpoint_interval(0)
        assert not engine._reentrant_activation_checkpointing()
        engine.train_batch(iter(_token_micro_batches()))
        assert counts == [(2 * STEPS + 1) * MICRO_BATCHES] * len(counts)

    def test_the_config_interval_replaces_the_modules_when_positive(self) -> None:
        stages = zcomm.get_world_size()
        kept = pipeline(stages, activation_checkpoint_interval=2)
        pipe_initialize(kept, pipe_config(pipeline={"activation_checkpoint_interval": 0}))
        assert kept.activation_checkpoint_interval == 2
        replaced = pipeline(stages, activation_checkpoint_interval=2)
        pipe_initialize(replaced, pipe_config(pipeline={"activation_checkpoint_interval": 3}))
        assert replaced.activation_checkpoint_interval == 3
        assert replaced.is_checkpointable_results_interval == 3


def _token_micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = global_batches(1, 8)[0]
    return [(t, t.roll(1, dims=1)) for t in tokens.chunk(MICRO_BATCHES)]


class TestConfigure(DistributedTest):
    world_size = (1, 2)

    def test_takes_the_engines_config_a_dict_and_a_path(self) -> None:
        saved = _recompute._settings
        try:
            self._configure_and_train()
        finally:
            _recompute._settings = saved

    def _configure_and_train(self) -> None:
        module = pipeline(zcomm.get_world_size())
        cfg = pipe_config(pipeline={"activation_checkpoint_interval": 1})
        engine = pipe_initialize(module, cfg)
        # DeepSpeed's call: the engine's config passed on, the arguments ruling
        checkpointing.configure(
            None,
            deepspeed_config=engine.config,
            partition_activations=True,
            contiguous_checkpointing=True,
            num_checkpoints=9,
        )
        settings = _recompute._settings
        assert (settings.partition, settings.contiguous, settings.num_layers) == (True, True, 9)
        assert not settings.cpu  # the engine's config holds no activation_checkpointing
        section = {"cpu_checkpointing": True, "profile": True}
        checkpointing.configure(None, deepspeed_config={**cfg, "activation_checkpointing": section})
        assert (_recompute._settings.cpu, _recompute._settings.profile) == (True, True)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "ds_config.json"
            path.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpointing": True}}))
            checkpointing.configure(None, deepspeed_config=str(path))
            assert (_recompute._settings.cpu, _recompute._settings.profile) == (True, False)
            checkpointing.configure(None, deepspeed_config=path, synchronize=True)
            assert (_recompute._settings.cpu, _recompute._settings.synchronize) == (
                True,
                True,
            )
        # the settings reach the pipeline's checkpoints, reentrant or not: the same training
        _trains_as_the_plain_model(engine)
        with pytest.raises(zengine.ConfigError, match="expected a dict or the path"):
            checkpointing.configure(None, deepspeed_config=42)  # type: ignore[arg-type]
