"""Writes the fixture: a Transformers Trainer output folder saved by the real DeepSpeed.

Run under ``torchrun --nproc-per-node 2 make.py`` in an environment with DeepSpeed 0.19.8 from
PyPI, Transformers and Accelerate (not this package: it is also called ``deepspeed``). It saves
a tiny Llama (``model/``, the starting weights), trains it with the Trainer at ZeRO-3 for
`STEPS` steps saving at step `SAVE_AT` (``checkpoint-<SAVE_AT>/``: DeepSpeed's
``global_step<SAVE_AT>/``, ``latest``, the 16-bit weights, the Trainer's state and RNG files),
then resumes a second run from that checkpoint, and writes both runs' losses to
``losses.json``. The scripts DeepSpeed copies into a checkpoint folder are DeepSpeed's code:
they are removed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the tests folder
from _helpers import TokenDataset, use_deepspeed_state  # noqa: E402

STEPS, SAVE_AT = 4, 2
CONFIG: dict[str, Any] = {  # Transformers' documented ZeRO-3 config, "auto" where it can be
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
}


def tiny_model() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def arguments(out: Path, deepspeed: dict[str, Any] | None) -> Any:
    """The run's TrainingArguments (also the resuming run's, in test_trainer_resume.py)."""
    return transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_AT,
        report_to=[],
        seed=0,
        ddp_backend="gloo",
        dataloader_drop_last=True,
        disable_tqdm=True,
        accelerator_config={"use_configured_state": True},
        deepspeed=deepspeed,
    )


def train(out: Path, model_dir: Path, resume: Path | None = None) -> list[float]:
    use_deepspeed_state(True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = transformers.Trainer(
        model=model, args=arguments(out, dict(CONFIG)), train_dataset=TokenDataset()
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    work = Path(sys.argv[1])
    model_dir = HERE / "model"
    if int(__import__("os").environ.get("RANK", "0")) == 0:
        tiny_model().save_pretrained(model_dir)
    torch.distributed.init_process_group("gloo")
    torch.distributed.barrier()
    straight = train(work / "straight", model_dir)
    saved = work / "straight" / f"checkpoint-{SAVE_AT}"
    resumed = train(work / "resumed", model_dir, resume=saved)
    if torch.distributed.get_rank() == 0:
        fixture = HERE / f"checkpoint-{SAVE_AT}"
        shutil.rmtree(fixture, ignore_errors=True)
        shutil.copytree(saved, fixture, ignore=shutil.ignore_patterns("zero_to_*.py"))
        import deepspeed  # the real one, for the record

        record = {
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
            "straight": straight,
            "resumed": resumed,
        }
        (HERE / "losses.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
