"""A Trainer and an Accelerate loop with DeepSpeed on a CPU machine, written as Hugging Face's
docs write them: no ``PartialState(backend="gloo")`` first. Run by test_cpu_as_written.py under
``torchrun --nproc-per-node 2`` (``trainer``, ``accelerate``) or ``accelerate launch
--use_deepspeed --zero_stage 3`` (``accelerate_launch``).

``cpu_as_written.py RUN_DIR MODEL_DIR MODE``: the DeepSpeed run first, as the first thing the
process does (Accelerate's state is made once per process, and that is what is under test);
then, for reference, the same run without DeepSpeed (DDP over gloo). Rank 0 writes both.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder
from _helpers import TokenDataset, write_result

RUN_DIR, MODEL_DIR, MODE = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
STEPS = 3

# Transformers' documented ZeRO-3 config: "auto" wherever the Trainer knows the value
DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "zero_optimization": {"stage": 3},
}


def trainer_run(name: str, deepspeed: bool) -> dict[str, Any]:
    args = transformers.TrainingArguments(
        output_dir=str(RUN_DIR / name),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        deepspeed=DS_CONFIG if deepspeed else None,
        use_cpu=not deepspeed,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train()
    found = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "world": trainer.args.world_size,
        "deepspeed": trainer.is_deepspeed_enabled,
    }
    del trainer, model
    gc.collect()
    return found


def accelerate_run(accelerator: Accelerator) -> dict[str, Any]:
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=2, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses: list[float] = []
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        # DeepSpeedPlugin's config clips at 1.0 (the engine does; this call then does nothing)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    found = {
        "losses": losses,
        "world": accelerator.num_processes,
        "deepspeed": str(accelerator.distributed_type) == "DistributedType.DEEPSPEED",
    }
    accelerator.free_memory()
    del model, optimizer
    gc.collect()
    return found


def without_deepspeed() -> None:
    """The reference run's state: Accelerate's made afresh for DDP on the CPU (what a second
    run in one process needs; not part of what is under test)."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)


torch.manual_seed(0)
if MODE == "trainer":
    zero3 = trainer_run("zero3", deepspeed=True)
    without_deepspeed()
    ddp = trainer_run("ddp", deepspeed=False)
elif MODE in ("accelerate", "accelerate_launch"):
    # under `accelerate launch --use_deepspeed` the plugin comes from the launcher's environment
    plugin = DeepSpeedPlugin(zero_stage=3) if MODE == "accelerate" else None
    zero3 = accelerate_run(Accelerator(deepspeed_plugin=plugin))
    without_deepspeed()
    ddp = accelerate_run(Accelerator(cpu=True))
else:
    raise SystemExit(f"cpu_as_written.py: unknown mode {MODE!r}")
write_result({"zero3": zero3, "ddp": ddp})
