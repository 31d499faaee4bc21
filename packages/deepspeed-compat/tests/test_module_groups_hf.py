"""Module groups on the architectures the first grouping rule kept a unit per module
([Note: module groups] in zpartition): a Llama under PEFT's LoRA (adapters in ``ModuleDict``s),
T5 (a ``ModuleList`` of sublayers in each block), Mixtral and Qwen2-MoE (fused experts with an
activation child; Qwen2-MoE's shared expert an MLP of its own). Real Transformers and PEFT
modules, built from tiny configs (nothing downloaded), at ZeRO-3 with no parameter persistent:
each decoder layer or block is gathered as one unit, and three steps through the engine give the
losses of the same model trained plainly on both ranks' batches."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import deepspeed
from _helpers import VOCAB, tiny_config
from unit.common import DistributedTest

CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
}


def _model(kind: str) -> tuple[torch.nn.Module, list[str]]:
    """A seeded tiny model of `kind` and the names of its blocks (each should be one unit)."""
    import transformers

    torch.manual_seed(0)
    if kind == "t5":
        model = transformers.T5ForConditionalGeneration(
            tiny_config("t5", dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        )
        return model, [f"{stack}.block.{i}" for stack in ("encoder", "decoder") for i in range(2)]
    if kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        )
        return transformers.AutoModelForCausalLM.from_config(config), [
            "model.layers.0",
            "model.layers.1",
        ]
    base = transformers.AutoModelForCausalLM.from_config(
        tiny_config("llama" if kind == "lora" else kind)
    )
    layers = ["model.layers.0", "model.layers.1"]
    if kind != "lora":
        return base, layers
    import peft

    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, lora), [f"base_model.model.{name}" for name in layers]


def _loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=batch, labels=batch).loss
    return loss


class TestHuggingFaceBlocks(DistributedTest):
    world_size = 2

    def test_each_block_is_one_unit_and_trains_as_plain(self) -> None:
        rank = dist.get_rank()
        for kind in ("lora", "t5", "mixtral", "qwen2_moe"):
            built, blocks = _model(kind)
            reference = copy.deepcopy(built)
            trainable = [p for p in built.parameters() if p.requires_grad]
            engine, *_ = deepspeed.initialize(
                model=built, model_parameters=trainable, config=copy.deepcopy(CONFIG)
            )
            assert engine.partitioned is not None
            names = [u.name for u in engine.partitioned.units if not u.persistent]
            assert set(blocks) <= set(names), (kind, names)
            inside = [n for n in names if any(n.startswith(b + ".") for b in blocks)]
            assert not inside, f"{kind}: units inside a block: {inside}"

            generator = torch.Generator().manual_seed(1)
            data = torch.randint(0, VOCAB, (3, 2 * 2, 12), generator=generator)
            optimizer = torch.optim.AdamW(
                [p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0
            )
            losses = []
            for batch in data:  # each step: rank r's half, and both halves plainly
                loss = _loss(engine, batch.chunk(2)[rank])
                engine.backward(loss)
                engine.step()
                plain = [_loss(reference, half) for half in batch.chunk(2)]
                torch.stack(plain).mean().backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                optimizer.zero_grad()
                assert loss.item() == pytest.approx(plain[rank].item(), rel=1e-5), kind
                losses.append(loss.item())
            assert len(set(losses)) == len(losses), f"{kind}: the steps changed nothing: {losses}"
            engine.destroy()
