"""torch.utils.checkpoint inside an engine's model: the recomputed forward in backward gathers
ZeRO-3 parameters again and the losses follow plain PyTorch (the config's
``activation_checkpointing`` section points users here)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zengine
from zcomm.testing import DistributedTest

from ._models import TinyGPT, global_batches, plain_losses
from .test_engine import LR, _config, _train


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
        cfg = _config(stage, zero_optimization=zero)
        engine, *_ = zengine.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        data = global_batches(4, 2 * world_size)
        torch.testing.assert_close(
            _train(engine, data), plain_losses(reference, data, lr=LR), rtol=1e-5, atol=0
        )
