"""TRL's trainers at ZeRO-3 on zstack, against the same trainers without DeepSpeed (DDP), from
the same saved weights: run under torchrun by test_trl.py.

``trl_trainers.py RUN_DIR MODEL_DIR REWARD_DIR``: every scenario in one launch, each a fresh
trainer; rank 0 writes what each logged. The first, DPO at ZeRO-3, is written as TRL's docs
write it, with no ``PartialState(backend="gloo")`` first. The reference and reward models are
full models, which TRL hands, at ZeRO-3, to its ``prepare_deepspeed`` (``deepspeed.initialize``
with Accelerate's config, edited: dotted keys added, the optimizer dropped, "auto" values left
in).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import datasets
import tokenizers
import torch
import transformers
import trl

import deepspeed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder
from _helpers import VOCAB, hf_zero_config, use_deepspeed_state, write_result

RUN_DIR, MODEL_DIR, REWARD_DIR = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
STEPS = 3


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' vocabulary, made in memory: Llama's
    default pad, bos and eos ids (0, 1, 2), then words "w4" ... "w127"."""
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), VOCAB)})
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def words(generator: torch.Generator, count: int) -> str:
    ids = torch.randint(4, VOCAB, (count,), generator=generator)
    return " ".join(f"w{i}" for i in ids.tolist())


def preference_data(samples: int = 16) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(0)
    rows = [(words(generator, 6), words(generator, 5), words(generator, 5)) for _ in range(samples)]
    prompt, chosen, rejected = zip(*rows, strict=True)
    return datasets.Dataset.from_dict(
        {"prompt": list(prompt), "chosen": list(chosen), "rejected": list(rejected)}
    )


def prompt_data(samples: int = 16) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(1)
    return datasets.Dataset.from_dict({"prompt": [words(generator, 6) for _ in range(samples)]})


def common_args(name: str, zero3: bool, *, as_written: bool = False) -> dict[str, Any]:
    """The arguments every run shares. `as_written`: the first run of the process, made as
    TRL's docs write it (no Accelerate state made first: the compat package gives Accelerate
    the world on a CPU machine); the others make Accelerate's state afresh for their kind."""
    if not as_written:
        use_deepspeed_state(zero3)
        # TrainingArguments(deepspeed=...) sets it, and Accelerate reads it in later states
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    state = {} if as_written else {"accelerator_config": {"use_configured_state": zero3}}
    return {
        **state,
        "output_dir": str(RUN_DIR / name),
        "max_steps": STEPS,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "seed": 0,
        "bf16": False,  # TRL's configs default to bf16; these runs compare in fp32
        "use_cpu": not zero3,
        "ddp_backend": "gloo",
        "disable_tqdm": True,
        "deepspeed": hf_zero_config(3) if zero3 else None,
    }


def logged(trainer: transformers.Trainer, *keys: str) -> dict[str, Any]:
    history = [h for h in trainer.state.log_history if "loss" in h]
    found: dict[str, Any] = {k: [h[k] for h in history] for k in keys}
    found["world"] = trainer.args.world_size
    found["deepspeed"] = trainer.is_deepspeed_enabled
    found["reference_is_engine"] = isinstance(trainer.ref_model, deepspeed.DeepSpeedEngine)
    return found


def dpo(name: str, zero3: bool, *, as_written: bool = False) -> dict[str, Any]:
    args = trl.DPOConfig(
        **common_args(name, zero3, as_written=as_written),
        per_device_train_batch_size=2,
        max_length=16,
        beta=0.1,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    reference = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=preference_data(),
        processing_class=tokenizer(),
    )
    trainer.train()
    found = logged(trainer, "loss", "logps/chosen", "logps/rejected", "rewards/margins")
    del trainer, model, reference
    gc.collect()
    return found


def grpo(name: str, zero3: bool, *, gather: bool = True) -> dict[str, Any]:
    """GRPO with a reward model (a sequence classifier) and a reference model (beta > 0): both
    go through ``prepare_deepspeed``. With `gather` (TRL's default) generation at ZeRO-3
    gathers the policy whole and takes the engine's hooks off it meanwhile (TRL's
    ``remove_hooks``/``add_hooks``, through the optimizer's ``parameter_offload``); without,
    generation runs through the engine's own ZeRO-3 forward, gathering layer by layer."""
    args = trl.GRPOConfig(
        **common_args(name, zero3),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        beta=0.1,
        ds3_gather_for_generation=gather,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    reward = transformers.AutoModelForSequenceClassification.from_pretrained(REWARD_DIR)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=prompt_data(),
        processing_class=tokenizer(),
        reward_processing_classes=tokenizer(),
    )
    trainer.train()
    found = logged(trainer, "loss", "reward", "kl")
    found["reward_is_engine"] = isinstance(trainer.reward_funcs[0], deepspeed.DeepSpeedEngine)
    del trainer, model, reward
    gc.collect()
    return found


results = {
    "dpo_zero3": dpo("dpo_zero3", zero3=True, as_written=True),
    "dpo_ddp": dpo("dpo_ddp", zero3=False),
    "grpo_ddp": grpo("grpo_ddp", zero3=False),
    "grpo_zero3": grpo("grpo_zero3", zero3=True),
    "grpo_zero3_layerwise": grpo("grpo_zero3_layerwise", zero3=True, gather=False),
}
write_result(results)
