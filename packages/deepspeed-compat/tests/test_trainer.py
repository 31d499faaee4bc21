"""Transformers' `Trainer` with a DeepSpeed config dict, on zstack, under ``torchrun`` with 2
ranks: losses equal the same Trainer without DeepSpeed (DDP) from the same saved weights, a run
resumed from a checkpoint continues bit-exactly, and ``save_model`` writes safetensors that load
without zstack. All scenarios run in one launch (scripts/trainer.py); each test reads its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from _helpers import save_tiny_model, torchrun

STEPS = 4  # optimizer steps, each over 2 micro-batches per rank (gradient accumulation)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("trainer")
    model_dir = save_tiny_model(run_dir / "model")
    return torchrun("trainer.py", str(run_dir), str(model_dir))


def _losses(runs: dict[str, Any], name: str) -> list[float]:
    found = runs[name]
    assert found["world"] == 2, f"{name}: the Trainer saw {found['world']} ranks, not 2"
    losses: list[float] = found["losses"]
    assert len(losses) == STEPS, f"{name}: {len(losses)} logged losses"
    return losses


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3_client_optimizer"])
def test_fp32_losses_equal_ddp(runs: dict[str, Any], name: str) -> None:
    """The "auto" values filled in by the Trainer; the optimizer from the config (AdamW), or the
    Trainer's own wrapped by the engine."""
    assert _losses(runs, name) == pytest.approx(_losses(runs, "ddp"), rel=1e-5, abs=0)


def test_fp32_training_moves_the_loss(runs: dict[str, Any]) -> None:
    """The comparison above means something: the weights change between steps."""
    losses = _losses(runs, "ddp")
    assert len(set(losses)) == STEPS


@pytest.mark.parametrize("name", ["zero2_bf16", "zero3_bf16"])
def test_bf16_losses_match_ddp_autocast(runs: dict[str, Any], name: str) -> None:
    """DeepSpeed's bf16 keeps bf16 weights and fp32 masters; DDP runs fp32 weights under bf16
    autocast: the same to bf16's precision (about 3 significant digits)."""
    assert _losses(runs, name) == pytest.approx(_losses(runs, "ddp_bf16"), rel=2e-3, abs=0)
    assert _losses(runs, name) != _losses(runs, "zero3")  # bf16 did run in bf16


def test_resume_from_checkpoint_continues_bit_exactly(runs: dict[str, Any]) -> None:
    """Saved at step 2 (a ZeRO-3 checkpoint with its optimizer state); the resumed run's steps
    3 and 4 equal the uninterrupted run's."""
    uninterrupted = _losses(runs, "zero3_saving")
    assert _losses(runs, "zero3_resumed") == uninterrupted
    assert uninterrupted == _losses(runs, "zero3")


def test_save_model_writes_safetensors_that_load_without_zstack(runs: dict[str, Any]) -> None:
    """Trainer.save_model at ZeRO-3 (``stage3_gather_16bit_weights_on_model_save``) writes the
    trained weights, whole, as a plain Transformers checkpoint."""
    final = Path(runs["zero3"]["reference"]).parent / "final"
    assert (final / "model.safetensors").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(final).state_dict()
    trained = torch.load(runs["zero3"]["reference"])
    assert loaded.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key
