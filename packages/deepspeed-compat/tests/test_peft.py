"""PEFT LoRA on a frozen base at ZeRO-3 through the Trainer, on zstack, under ``torchrun`` with
2 ranks: it trains, its losses equal LoRA without DeepSpeed, and the adapter it saves loads on an
unpartitioned model (scripts/peft_lora.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import pytest
import safetensors.torch
import torch
import transformers

from _helpers import save_tiny_model, token_batches, torchrun


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("peft")
    save_tiny_model(run_dir / "model")
    found = torchrun("peft_lora.py", str(run_dir), str(run_dir / "model"))
    found["model"] = str(run_dir / "model")
    return found


def test_lora_at_zero3_trains_and_equals_lora_without_deepspeed(runs: dict[str, Any]) -> None:
    assert runs["zero3"]["partitioned"], "the base was not partitioned: ZeRO-3 was not on"
    assert runs["zero3"]["trainable"] == runs["plain"]["trainable"] == 8  # A and B, 2 x 2 layers
    losses = runs["zero3"]["losses"]
    assert len(set(losses)) == len(losses) == 4
    assert losses == pytest.approx(runs["plain"]["losses"], rel=1e-5, abs=0)


def test_resume_from_a_checkpoint_without_the_frozen_base(runs: dict[str, Any]) -> None:
    """The Trainer saves PEFT's ZeRO-3 checkpoints without the frozen base
    (``exclude_frozen_parameters``) and loads them with ``load_module_strict=False``: the
    resumed steps 3 and 4 equal the uninterrupted run's."""
    global_step = Path(runs["zero3_saving"]["adapter"]).parent / "checkpoint-2" / "global_step2"
    assert global_step.is_dir()
    assert runs["zero3_resumed"]["losses"] == runs["zero3_saving"]["losses"]
    assert runs["zero3_saving"]["losses"] == runs["zero3"]["losses"]


def test_saved_adapter_loads_on_an_unpartitioned_model(runs: dict[str, Any]) -> None:
    """Only the adapter's weights are saved, whole (gathered from the shards), and they give the
    same model as the adapter trained without DeepSpeed."""
    saved = {
        name: safetensors.torch.load_file(Path(runs[name]["adapter"]) / "adapter_model.safetensors")
        for name in ("plain", "zero3")
    }
    assert saved["zero3"].keys() == saved["plain"].keys()
    assert all("lora_" in key for key in saved["zero3"])
    for key, value in saved["plain"].items():
        torch.testing.assert_close(saved["zero3"][key], value, rtol=1e-4, atol=1e-6, msg=key)

    batch = token_batches(1, 2)[0]
    outputs = []
    for name in ("plain", "zero3"):
        base = transformers.AutoModelForCausalLM.from_pretrained(runs["model"])
        model = peft.PeftModel.from_pretrained(base, runs[name]["adapter"]).eval()
        with torch.no_grad():
            outputs.append(model(input_ids=batch).logits)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
    untrained = transformers.AutoModelForCausalLM.from_pretrained(runs["model"]).eval()
    with torch.no_grad():
        assert not torch.allclose(untrained(input_ids=batch).logits, outputs[1])
