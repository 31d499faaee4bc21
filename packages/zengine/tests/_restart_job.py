"""A training job for ``torchrun --max-restarts``: it checkpoints every 2 steps, and in its first
attempt rank 1 kills itself (SIGKILL, no cleanup) in the middle of step 5. The restarted job
loads the latest checkpoint, continues from the data position saved in it, and at the end
trains the same steps again without a break, for the test to compare the final losses.

Usage: torchrun --nproc-per-node 2 --max-restarts 1 _restart_job.py SAVE_DIR RESULT_JSON
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

import zcomm
import zengine

sys.path.insert(0, str(Path(__file__).parent))
from _helpers import TinyGPT, global_batches  # type: ignore[import-not-found]

STEPS, EVERY, KILL_AT = 8, 2, 5
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 1000,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 16},
}


def engine() -> zengine.Engine:
    torch.manual_seed(0)
    model = TinyGPT()
    built, *_ = zengine.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    return built


def step(e: zengine.Engine, tokens: torch.Tensor) -> float:
    mine = tokens.view(zcomm.get_world_size(), -1, tokens.shape[-1])[zcomm.get_rank()]
    loss = e(mine)
    e.backward(loss)
    e.step()
    total = loss.detach().reshape(1)
    zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG)
    return total.item()


def main() -> None:
    save_dir, result = Path(sys.argv[1]), Path(sys.argv[2])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    zcomm.init_distributed()  # keeps the attempts' keys apart under torchrun
    data = global_batches(STEPS, 4)
    e = engine()
    _, client = e.load_checkpoint(save_dir)
    client = client or {"next_step": 0}
    # an attempt that finds the last checkpoint (the attempt before failed after saving it,
    # say at exit: zcomm's [Note: works released at exit]) has no step left: it reports what
    # that checkpoint recorded
    start, resumed_at, final = client["next_step"], client.get("resumed_at"), client.get("loss")
    if start < STEPS:
        resumed_at = start
    for i in range(start, STEPS):
        if attempt == 0 and i == KILL_AT and zcomm.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        final = step(e, data[i])
        if (i + 1) % EVERY == 0:
            state = {"next_step": i + 1, "resumed_at": resumed_at, "loss": final}
            e.save_checkpoint(save_dir, client_state=state)
    straight = engine()
    reference = [step(straight, tokens) for tokens in data]
    if zcomm.get_rank() == 0:
        report = {
            "attempt": attempt,
            "resumed_at": resumed_at,
            "final": final,
            "reference": reference[-1],
        }
        result.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
