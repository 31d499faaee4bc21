"""load_config on what Accelerate, Transformers and TRL write into a DeepSpeed config: dotted
top-level keys (the nested key, replaced), "auto" values in the config of a model without an
optimizer (the defaults), and a misspelt key, dotted or not, still named with its closest key.
[Note: dotted keys and "auto"]"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import zengine
from zcomm.testing import DistributedTest
from zengine._config import ConfigError, load_config, read_section

HIDDEN = 64

# What Transformers' Trainer hands Accelerate before training: the batch sizes and the optimizer
# filled, the hidden-size keys still "auto" (filled once the model is prepared)
TRAINER_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "offload_optimizer": {"device": "none"},
    },
}


def trl_reference_config(config: dict[str, Any] = TRAINER_CONFIG) -> dict[str, Any]:
    """The config TRL 1.16's ``prepare_deepspeed`` gives ``deepspeed.initialize`` for a reference
    model, made as it makes it."""
    edited = copy.deepcopy(config)
    edited.update(
        {
            "zero_optimization.reduce_bucket_size": HIDDEN * HIDDEN,
            "zero_optimization.stage3_param_persistence_threshold": 10 * HIDDEN,
            "zero_optimization.stage3_prefetch_bucket_size": 0.9 * HIDDEN * HIDDEN,
        }
    )
    edited.pop("optimizer", None)
    edited.pop("scheduler", None)
    edited["zero_optimization"].pop("offload_optimizer", None)
    return edited


def _problems(config: dict[str, Any], **kwargs: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(config, world_size=2, **kwargs)
    return list(info.value.problems)


def test_trls_reference_config_loads_with_its_dotted_values() -> None:
    cfg = load_config(trl_reference_config(), world_size=2, with_optimizer=False)
    zero = cfg.zero_optimization
    assert zero.stage == 3
    assert zero.reduce_bucket_size == HIDDEN * HIDDEN
    assert zero.stage3_param_persistence_threshold == 10 * HIDDEN
    # TRL writes 0.9 * hidden**2 unrounded; Accelerate and Transformers write int() of it
    assert zero.stage3_prefetch_bucket_size == int(0.9 * HIDDEN * HIDDEN)
    assert cfg.optimizer is None
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (4, 2)


def test_a_dotted_key_replaces_the_nested_value() -> None:
    config = {
        "train_batch_size": 4,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
        "zero_optimization.reduce_bucket_size": 2000,
        "bf16.enabled": True,
    }
    cfg = load_config(config, world_size=2)
    assert cfg.zero_optimization.reduce_bucket_size == 2000
    assert cfg.zero_optimization.stage == 2  # the section's other keys stay
    assert cfg.bf16.enabled  # a section the config did not have is made
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}  # not edited


def test_a_dotted_key_is_validated_as_the_nested_key() -> None:
    config = {"train_batch_size": 4, "zero_optimization.stage": "three"}
    assert _problems(config) == ["zero_optimization.stage: expected an integer, got 'three'"]
    # a fractional float is rounded only for a count: the stage is not one
    assert _problems({"train_batch_size": 4, "zero_optimization.stage": 2.5}) == [
        "zero_optimization.stage: expected an integer, got 2.5"
    ]


def test_a_fractional_count_written_nested_is_still_refused() -> None:
    config = {"train_batch_size": 4, "zero_optimization": {"reduce_bucket_size": 3686.4}}
    assert _problems(config) == [
        "zero_optimization.reduce_bucket_size: expected a whole number, got 3686.4"
    ]


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (
            "zero_optimization.reduce_bucket_sise",
            "zero_optimization.reduce_bucket_sise: unknown key; did you mean 'reduce_bucket_size'?",
        ),
        (
            "zero_optimisation.stage",
            "zero_optimisation: unknown key; did you mean 'zero_optimization'?",
        ),
        ("train_batch_sise", "train_batch_sise: unknown key; did you mean 'train_batch_size'?"),
    ],
)
def test_a_misspelt_key_dotted_or_not_is_named_with_its_closest_key(
    key: str, expected: str
) -> None:
    assert _problems({"train_batch_size": 4, key: 1}) == [expected]
    config = {**trl_reference_config(), key: 1}
    assert expected in _problems(config, with_optimizer=False)


def test_a_dotted_key_into_a_value_that_is_not_a_section_is_refused() -> None:
    assert _problems({"train_batch_size": 4, "train_batch_size.x": 1}) == [
        "train_batch_size.x: a dotted key for a nested one, but train_batch_size is not a "
        "section (got 4)"
    ]


def test_auto_in_a_training_config_is_still_an_error() -> None:
    """A training run that left "auto" unfilled would train with values no one chose."""
    config = {**TRAINER_CONFIG, "gradient_clipping": "auto"}
    assert _problems(config) == [
        "gradient_clipping: expected a number, got 'auto'",
        "zero_optimization.reduce_bucket_size: expected an integer, got 'auto'",
        "zero_optimization.stage3_prefetch_bucket_size: expected an integer, got 'auto'",
        "zero_optimization.stage3_param_persistence_threshold: expected an integer, got 'auto'",
    ]


def test_auto_without_an_optimizer_takes_the_defaults() -> None:
    config = {
        **trl_reference_config(),
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
    }
    del config["zero_optimization.reduce_bucket_size"]
    cfg = load_config(config, world_size=2, with_optimizer=False)
    defaults = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 3}}, world_size=2)
    assert cfg.zero_optimization.reduce_bucket_size == defaults.zero_optimization.reduce_bucket_size
    assert cfg.gradient_clipping == defaults.gradient_clipping
    assert cfg.bf16.enabled is False


def test_batch_sizes_all_auto_without_an_optimizer_are_one_sample_per_rank() -> None:
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }
    cfg = load_config(config, world_size=2, with_optimizer=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (2, 1)
    assert cfg.gradient_accumulation_steps == 1


def test_read_section_reads_dotted_keys() -> None:
    section = read_section(
        {"zero_optimization.stage": 3, "bf16": {"enabled": True}}, "zero_optimization"
    )
    assert section["stage"] == 3


class TestInitializeAReferenceModel(DistributedTest):
    @pytest.mark.parametrize("world_size", [1])
    def test_trls_config_makes_an_engine_without_an_optimizer(self, world_size: int) -> None:
        """``initialize`` with TRL's config and no optimizer: an engine for forward passes at
        ZeRO-3 whose outputs are the model's; with an optimizer the "auto" values are refused."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        inputs = torch.randn(3, 8)
        expected = model(inputs).detach()
        config = trl_reference_config({**TRAINER_CONFIG, "train_batch_size": 2})
        engine, optimizer, _, _ = zengine.initialize(model=model, config=config)
        assert optimizer is None
        assert engine.zero_optimization_stage() == 3
        with torch.no_grad():
            assert torch.equal(engine(inputs), expected)
        training = {**config, "zero_optimization.reduce_bucket_size": "auto"}
        with pytest.raises(
            ConfigError, match="reduce_bucket_size: expected an integer, got 'auto'"
        ):
            zengine.initialize(
                model=nn.Linear(4, 4),
                config={**training, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
            )


def test_a_batch_size_of_one_ranks_samples_names_the_two_lines() -> None:
    """Filled by a Trainer or an Accelerator that counted a world of one (Accelerate on a CPU
    machine, its state made with no backend): the error says what to add."""
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
    }
    (problem,) = _problems(config)
    assert problem.startswith(
        "train_batch_size 4 != train_micro_batch_size_per_gpu 2 * gradient_accumulation_steps 2 "
        "* world size 2 = 8 (train_batch_size counts one rank's samples"
    )
    assert '`PartialState(backend="gloo")`' in problem
    assert "`from accelerate import PartialState`" in problem
    # another mismatch is only the sums
    (problem,) = _problems({**config, "train_batch_size": 6})
    assert problem.endswith("world size 2 = 8")
