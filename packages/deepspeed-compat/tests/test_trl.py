"""TRL's trainers at ZeRO-3 on zstack, 2 ranks under ``torchrun``: `DPOTrainer` with a full
reference model, and `GRPOTrainer` with a reward model and a reference model, each of which TRL
hands to ``deepspeed.initialize`` through its ``prepare_deepspeed`` (a config it edits: dotted
keys added, the optimizer dropped, "auto" values left in). The losses equal the same trainers'
without DeepSpeed (DDP over gloo). All scenarios run in one launch (scripts/trl_trainers.py);
the first, DPO at ZeRO-3, as TRL's docs write it (no ``PartialState(backend="gloo")`` first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from _helpers import save_tiny_model, tiny_config, torchrun

STEPS = 3


def _save_reward_model(path: Path) -> Path:
    """A sequence classifier (one score) with seeded weights: the reward model."""
    import torch
    import transformers

    torch.manual_seed(1)
    config = tiny_config("llama", num_labels=1, pad_token_id=0)
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("trl")
    model_dir = save_tiny_model(run_dir / "model")
    reward_dir = _save_reward_model(run_dir / "reward")
    return torchrun("trl_trainers.py", str(run_dir), str(model_dir), str(reward_dir))


def _logged(runs: dict[str, Any], name: str, key: str) -> list[float]:
    found = runs[name]
    assert found["world"] == 2, f"{name}: the trainer saw {found['world']} ranks, not 2"
    values: list[float] = found[key]
    assert len(values) == STEPS, f"{name}: {len(values)} logged {key} values"
    return values


@pytest.mark.parametrize("key", ["loss", "logps/chosen", "logps/rejected", "rewards/margins"])
def test_dpo_with_a_full_reference_model_equals_ddp(runs: dict[str, Any], key: str) -> None:
    """The reference model is an engine at ZeRO-3 (made by TRL's ``prepare_deepspeed``).
    DPO's rewards are beta times a difference of log-probabilities near -29: fp32 resolves
    them to about 1e-7 absolute, not relative."""
    assert runs["dpo_zero3"]["reference_is_engine"], "the reference model was not an engine"
    assert not runs["dpo_ddp"]["deepspeed"]
    zero3, ddp = _logged(runs, "dpo_zero3", key), _logged(runs, "dpo_ddp", key)
    if key.startswith("rewards/"):
        assert zero3 == pytest.approx(ddp, rel=0, abs=1e-6)
    else:
        assert zero3 == pytest.approx(ddp, rel=1e-5, abs=0)


def test_dpo_training_moves_the_loss(runs: dict[str, Any]) -> None:
    """The comparison means something: the policy moves away from the reference."""
    assert len(set(_logged(runs, "dpo_ddp", "loss"))) == STEPS


@pytest.mark.parametrize("key", ["loss", "reward", "kl"])
@pytest.mark.parametrize("run", ["grpo_zero3", "grpo_zero3_layerwise"])
def test_grpo_with_reward_and_reference_models_equals_ddp(
    runs: dict[str, Any], run: str, key: str
) -> None:
    """`grpo_zero3` generates as TRL does by default (``ds3_gather_for_generation``: the
    policy gathered whole, the engine's hooks off), `grpo_zero3_layerwise` through the
    engine's ZeRO-3 forward."""
    assert runs[run]["reward_is_engine"], "the reward model was not an engine"
    assert runs[run]["reference_is_engine"], "the reference model was not an engine"
    assert not runs["grpo_ddp"]["deepspeed"]
    zero3, ddp = _logged(runs, run, key), _logged(runs, "grpo_ddp", key)
    assert zero3 == pytest.approx(ddp, rel=1e-5, abs=1e-7)


def test_grpo_training_moves_the_reward(runs: dict[str, Any]) -> None:
    """The comparison means something: the reward model scores a policy that changes (GRPO's
    first loss is 0: on-policy, no KL to the reference yet)."""
    assert len(set(_logged(runs, "grpo_ddp", "reward"))) == STEPS
