"""Transformers' Trainer with a DeepSpeed config on zstack, against the same Trainer without
DeepSpeed (DDP), from the same saved weights: run under torchrun by test_trainer.py.

``trainer.py RUN_DIR MODEL_DIR``: every scenario in one launch (starting the ranks costs more
than the runs), each a fresh Trainer; rank 0 writes the logged losses of each.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder
from _helpers import TokenDataset, hf_zero_config, use_deepspeed_state, write_result

RUN_DIR, MODEL_DIR = Path(sys.argv[1]), Path(sys.argv[2])

# Transformers refuses `bf16=True` on a machine without a bf16 accelerator unless `use_cpu`,
# which turns DeepSpeed off; zstack's engine trains in bf16 on the CPU, so the guard is lifted
# for these runs (on a GPU it passes by itself).
transformers.training_args.is_torch_bf16_gpu_available = lambda: True


def ds_config(stage: int, *, client_optimizer: bool = False) -> dict[str, Any]:
    config = hf_zero_config(stage)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if client_optimizer:  # the Trainer's own AdamW, wrapped by the engine
        del config["optimizer"]
    return config


def train(
    name: str,
    *,
    stage: int | None = None,
    bf16: bool = False,
    steps: int = 4,
    save_steps: int | None = None,
    resume: str | None = None,
    client_optimizer: bool = False,
    save_model: bool = False,
) -> dict[str, Any]:
    use_deepspeed_state(stage is not None)
    out = RUN_DIR / name
    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        seed=0,
        bf16=bf16,
        use_cpu=stage is None,
        ddp_backend="gloo",
        dataloader_drop_last=True,
        disable_tqdm=True,
        accelerator_config={"use_configured_state": stage is not None},
        deepspeed=ds_config(stage, client_optimizer=client_optimizer)
        if stage is not None
        else None,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train(resume_from_checkpoint=resume)
    found: dict[str, Any] = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "world": trainer.args.world_size,
    }
    if save_model:
        trainer.save_model(str(out / "final"))
        found["reference"] = str(out / "reference.pt")
        params = list(trainer.model.parameters())
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            if trainer.args.process_index == 0:
                state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
                torch.save(state, found["reference"])
    del trainer, model
    gc.collect()
    return found


results = {
    "ddp": train("ddp"),
    "zero2": train("zero2", stage=2),
    "zero3": train("zero3", stage=3, save_model=True),
    "zero3_client_optimizer": train("zero3_client", stage=3, client_optimizer=True),
    "ddp_bf16": train("ddp_bf16", bf16=True),
    "zero2_bf16": train("zero2_bf16", stage=2, bf16=True),
    "zero3_bf16": train("zero3_bf16", stage=3, bf16=True),
    "zero3_saving": train("zero3_saving", stage=3, save_steps=2),
}
results["zero3_resumed"] = train(
    "zero3_resumed", stage=3, resume=str(RUN_DIR / "zero3_saving" / "checkpoint-2")
)
write_result(results)
