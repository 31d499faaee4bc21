"""PEFT LoRA on a frozen base through Transformers' Trainer at ZeRO-3 on zstack, against the
same LoRA run without DeepSpeed: run under torchrun by test_peft.py.

``peft_lora.py RUN_DIR MODEL_DIR``: rank 0 writes each run's losses and where its adapter was
saved.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import peft
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder
from _helpers import TokenDataset, use_deepspeed_state, write_result

RUN_DIR, MODEL_DIR = Path(sys.argv[1]), Path(sys.argv[2])

ZERO3: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
}


def run(
    name: str, zero3: bool, *, save_steps: int | None = None, resume: str | None = None
) -> dict[str, Any]:
    use_deepspeed_state(zero3)
    out = RUN_DIR / name
    args = transformers.TrainingArguments(  # made first: with DeepSpeed it switches ZeRO-3 on
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        seed=0,
        use_cpu=not zero3,
        ddp_backend="gloo",
        disable_tqdm=True,
        accelerator_config={"use_configured_state": zero3},
        deepspeed=ZERO3 if zero3 else None,
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    torch.manual_seed(0)  # the adapter's initial weights, the same in both runs
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, lora)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(out / "adapter"))
    found = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "adapter": str(out / "adapter"),
        "partitioned": all(hasattr(p, "ds_id") for p in trainer.model.parameters()),
        "trainable": sum(p.requires_grad for p in trainer.model.parameters()),
    }
    del trainer, model, base
    gc.collect()
    return found


results = {
    "plain": run("plain", False),
    "zero3": run("zero3", True),
    # checkpoints without the frozen base (exclude_frozen_parameters), loaded non-strictly
    "zero3_saving": run("zero3_saving", True, save_steps=2),
}
results["zero3_resumed"] = run(
    "zero3_resumed", True, resume=str(RUN_DIR / "zero3_saving" / "checkpoint-2")
)
write_result(results)
