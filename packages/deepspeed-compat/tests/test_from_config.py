"""Hugging Face models built from configs under `zpartition.Init` get Transformers' weight
initialisation: ``post_init`` runs ``initialize_weights`` (its own recursion, not
``nn.Module.apply``) at the end of the top model's ``__init__``, when every child is already
cut, so before `Init` gathered what an initialisation writes, the writes were lost (first loss
61.9 for a tiny Llama, instead of ln(vocab))."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import zcomm
import zpartition
from _helpers import VOCAB, tiny_config
from zcomm.testing import DistributedTest


def _build(kind: str, seed: int = 0) -> transformers.PreTrainedModel:
    masked = kind == "bert"
    auto: Any = transformers.AutoModelForMaskedLM if masked else transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    # token 0 pads, so its embedding row is zeroed
    model: transformers.PreTrainedModel = auto.from_config(tiny_config(kind, pad_token_id=0))
    return model


def _first_loss(model: nn.Module) -> float:
    tokens = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # GPT-2 and BERT are built in training mode: the same dropout masks
    with torch.no_grad():
        return float(model(input_ids=tokens, labels=tokens).loss)


KINDS = pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])


class TestFromConfigUnderInit(DistributedTest):
    @KINDS
    @SIZES
    def test_weights_and_first_loss_as_without_init(self, world_size: int, kind: str) -> None:
        """Rank 0's values everywhere, and they are exactly the unpartitioned model's: rank 0
        computes what it would without `Init` (it reads its own values back). The other ranks
        draw from other seeds here, and end with rank 0's values all the same."""
        reference = _build(kind, seed=0)
        with zpartition.Init():
            model = _build(kind, seed=zcomm.get_rank())
        expected = dict(reference.named_parameters())
        with zpartition.GatheredParameters(list(model.parameters())):
            got = {name: p.detach().clone() for name, p in model.named_parameters()}
        assert got.keys() == expected.keys()
        for name, value in got.items():
            assert torch.equal(value, expected[name].detach()), name
        embeddings = model.get_input_embeddings()
        assert isinstance(embeddings, nn.Embedding)
        weight = embeddings.weight
        if kind != "gpt2":  # GPT-2's embedding has no padding row
            with zpartition.GatheredParameters(weight):
                assert torch.equal(weight[0], torch.zeros_like(weight[0]))
        zpartition.partition(model, config=zpartition.ZeroParamConfig())
        loss = _first_loss(model)
        assert abs(loss - math.log(VOCAB)) < 0.3, loss
        assert loss == pytest.approx(_first_loss(reference), rel=1e-4)
