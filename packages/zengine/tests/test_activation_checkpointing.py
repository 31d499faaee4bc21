"""Activation checkpointing inside an engine's model, torch's (torch.utils.checkpoint) and
DeepSpeed's (zengine.checkpointing): the recomputed forward in backward gathers ZeRO-3
parameters again and the losses follow plain PyTorch."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zengine
from zcomm.testing import DistributedTest
from zengine import ConfigError, _recompute, checkpointing

from ._helpers import LR, TinyGPT, engine_config, global_batches, plain_losses, train_engine


class Checkpointed(TinyGPT):
    """TinyGPT whose blocks keep no activations: each is recomputed in backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__(blocks=3)
        self.reentrant = reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, dims=1).flatten())


class TestActivationCheckpointing(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize("stage", [0, 2, 3])
    @pytest.mark.parametrize("reentrant", [False, True])
    def test_losses_follow_plain_pytorch(
        self, world_size: int, stage: int, reentrant: bool
    ) -> None:
        torch.manual_seed(0)
        model = Checkpointed(reentrant)
        reference = copy.deepcopy(model)
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}  # every block gathered
        cfg = engine_config(stage, zero_optimization=zero)
        engine, *_ = zengine.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        data = global_batches(4, 2 * world_size)
        torch.testing.assert_close(
            train_engine(engine, data), plain_losses(reference, data, lr=LR), rtol=1e-5, atol=0
        )


# -- zengine.checkpointing (DeepSpeed's deepspeed.checkpointing) ---------------------------------


@pytest.fixture(autouse=True)
def _settings_restored() -> Iterator[None]:
    """`configure` sets module-wide settings: each test starts from, and leaves, the defaults."""
    saved = _recompute._settings
    yield
    _recompute._settings = saved


class DeepSpeedCheckpointed(TinyGPT):
    """TinyGPT whose blocks go through ``zengine.checkpointing.checkpoint``; counts their runs."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(blocks=3)
        self.dropout = nn.Dropout(dropout)
        self.runs = 0

    def _block(self, block: nn.Module, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        self.runs += 1
        return self.dropout(block(x)) * scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpointing.checkpoint(self._block, block, x, scale=1.0)
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, dims=1).flatten())


class TestDeepSpeedCheckpointing(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize("stage", [0, 3])
    @pytest.mark.parametrize("cpu", [False, True])
    def test_losses_follow_plain_pytorch(self, world_size: int, stage: int, cpu: bool) -> None:
        section = {"cpu_checkpointing": cpu, "synchronize_checkpoint_boundary": True}
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": section})
        torch.manual_seed(0)
        model = DeepSpeedCheckpointed()
        reference = copy.deepcopy(model)
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
        engine, *_ = zengine.initialize(
            model=model, config=engine_config(stage, zero_optimization=zero)
        )
        data = global_batches(3, 2 * world_size)
        with checkpointing_off():
            expected = plain_losses(reference, data, lr=LR)
        assert reference.runs == 3 * 3  # once a step each: nothing recomputed
        torch.testing.assert_close(train_engine(engine, data), expected, rtol=1e-5, atol=0)
        assert model.runs == 2 * 3 * 3  # each block recomputed in backward
        engine.destroy()

    @pytest.mark.parametrize("world_size", [1])
    def test_dropout_draws_the_same_masks_again(self, world_size: int) -> None:
        checkpointing.configure(None, checkpoint_in_cpu=True)
        torch.manual_seed(0)
        model = DeepSpeedCheckpointed(dropout=0.3)
        reference = copy.deepcopy(model)
        engine, *_ = zengine.initialize(model=model, config=engine_config(0))
        data = global_batches(3, 2)
        torch.manual_seed(1)
        losses = train_engine(engine, data)
        torch.manual_seed(1)
        with checkpointing_off():
            expected = plain_losses(reference, data, lr=LR)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)


@contextlib.contextmanager
def checkpointing_off() -> Iterator[None]:
    """``checkpointing.checkpoint`` calls its function straight (the plain run)."""
    saved = checkpointing.checkpoint
    checkpointing.checkpoint = lambda function, *args, **kwargs: function(*args, **kwargs)
    try:
        yield
    finally:
        checkpointing.checkpoint = saved


class _Mpu:
    def __init__(self, size: int) -> None:
        self.size = size

    def get_model_parallel_world_size(self) -> int:
        return self.size


def test_configure_takes_the_section_and_its_arguments_over_it() -> None:
    assert not checkpointing.is_configured()
    config = {"train_batch_size": 1, "activation_checkpointing": {"cpu_checkpointing": True}}
    checkpointing.configure(None, deepspeed_config=config, profile=True)
    assert checkpointing.is_configured()
    settings = _recompute._settings
    assert settings.cpu
    assert settings.profile
    checkpointing.configure(None, deepspeed_config=config, checkpoint_in_cpu=False)
    assert not _recompute._settings.cpu
    # nothing to split without model parallelism: taken with a model-parallel group of 1
    checkpointing.configure(_Mpu(1), partition_activations=True)


def test_configure_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="contiguous_checkpointing needs partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="model-parallel group of 2 ranks"):
        checkpointing.configure(_Mpu(2), partition_activations=True)
    bad = {"activation_checkpointing": {"cpu_checkpointin": True}}
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.cpu_checkpointin: unknown"):
        checkpointing.configure(None, deepspeed_config=bad)
    assert not checkpointing.is_configured()  # a refused call changes nothing


def test_profile_logs_the_forward_and_the_recomputation(caplog: pytest.LogCaptureFixture) -> None:
    checkpointing.configure(None, profile=True)
    layer = nn.Linear(4, 4)
    with caplog.at_level(logging.INFO, logger="zengine.checkpointing"):
        checkpointing.checkpoint(layer, torch.randn(2, 4, requires_grad=True)).sum().backward()
    said = [r.getMessage().split(" of ")[0] for r in caplog.records]
    assert said == ["checkpointing: forward", "checkpointing: recomputation"]
    assert layer.weight.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_checkpointing_keeps_the_inputs_off_the_device() -> None:
    blocks = [nn.Linear(1024, 1024, device="cuda") for _ in range(8)]

    def kept(cpu: bool) -> int:
        """Device bytes a forward through the checkpointed blocks leaves for backward."""
        checkpointing.configure(None, checkpoint_in_cpu=cpu)
        x = torch.randn(512, 1024, device="cuda", requires_grad=True)
        before = torch.cuda.memory_allocated()
        y = x
        for block in blocks:
            y = checkpointing.checkpoint(block, y)
        after = torch.cuda.memory_allocated()
        y.sum().backward()
        return after - before

    activation = 512 * 1024 * 4
    on_device, on_host = kept(False), kept(True)
    assert on_device >= 8 * activation  # each block's input and the last output
    assert on_host <= 2 * activation  # the last output (and x's copy to the host is not here)
