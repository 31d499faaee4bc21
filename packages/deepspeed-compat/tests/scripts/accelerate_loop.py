"""An Accelerate training loop with a DeepSpeed plugin on zstack, against the same loop without
DeepSpeed: run under torchrun by test_accelerate.py.

``accelerate_loop.py RUN_DIR MODEL_DIR``: rank 0 writes each run's losses, and what
``save_state``/``load_state``, ``get_state_dict`` and ``unwrap_model`` gave.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder
from _helpers import TokenDataset, use_deepspeed_state, write_result

RUN_DIR, MODEL_DIR = Path(sys.argv[1]), Path(sys.argv[2])
ACCUMULATION = 2


def run(name: str, stage: int | None, *, steps: int = 6, save_at: int = 3) -> dict[str, Any]:
    """`steps` optimizer steps, the state saved after `save_at`; then the state loaded back into
    a fresh run, which repeats the steps after `save_at`."""
    use_deepspeed_state(stage is not None)
    plugin = (
        DeepSpeedPlugin(
            zero_stage=stage,
            gradient_accumulation_steps=ACCUMULATION,
            zero3_save_16bit_model=True,
        )
        if stage is not None
        else None
    )
    accelerator = Accelerator(
        deepspeed_plugin=plugin, gradient_accumulation_steps=ACCUMULATION, cpu=stage is None
    )
    losses, state_dir = _train(accelerator, steps, save_at, RUN_DIR / name)
    model = accelerator._models[0]
    state = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    found: dict[str, Any] = {
        "losses": losses,
        "world": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "unwrapped": type(unwrapped).__name__,
        "state_dict": str(RUN_DIR / name / "state_dict.pt"),
    }
    if accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in state.items()}, found["state_dict"])
    accelerator.free_memory()
    del accelerator, model
    gc.collect()

    # a fresh run from the saved state repeats the last steps
    use_deepspeed_state(stage is not None)
    if plugin is not None:
        plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=ACCUMULATION)
    accelerator = Accelerator(
        deepspeed_plugin=plugin, gradient_accumulation_steps=ACCUMULATION, cpu=stage is None
    )
    found["resumed_losses"], _ = _train(accelerator, steps, save_at, None, resume=state_dir)
    accelerator.free_memory()
    gc.collect()
    return found


def _train(
    accelerator: Accelerator,
    steps: int,
    save_at: int,
    out: Path | None,
    resume: Path | None = None,
) -> tuple[list[float], Path]:
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=steps)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=2, drop_last=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    batches = list(loader)  # each rank's batches, in order
    first = 0
    if resume is not None:
        accelerator.load_state(str(resume))
        first = save_at
    losses: list[float] = []
    state_dir = (out or Path()) / "state"
    for step in range(first, steps):
        total = torch.zeros(())
        for micro in range(ACCUMULATION):
            with accelerator.accumulate(model):
                loss = model(**batches[step * ACCUMULATION + micro]).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # DeepSpeed clips by its config (1.0 here)
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total += loss.detach().float() / ACCUMULATION
        losses.append(accelerator.reduce(total, "mean").item())
        if out is not None and step + 1 == save_at:
            accelerator.save_state(str(state_dir))
    return losses, state_dir


write_result({"ddp": run("ddp", None), "zero2": run("zero2", 2), "zero3": run("zero3", 3)})
