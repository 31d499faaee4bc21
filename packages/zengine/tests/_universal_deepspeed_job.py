"""DeepSpeed's side of test_checkpoint_universal.py, run with the real DeepSpeed under torchrun:
the same run as zstack's from the same start, then a fresh engine that loads zstack's universal
export (``"checkpoint": {"load_universal": true}``) and continues it.

Usage: torchrun --nproc-per-node W _universal_deepspeed_job.py SAVE_DIR JOB_DIR

SAVE_DIR is zstack's ``save_dir`` (``latest_universal`` and ``zstack.pt``, zstack's state at the
save); JOB_DIR holds ``config.json`` and gets ``result.json``: the losses of both runs, what
DeepSpeed holds after the load (counters, learning rates, client state) and the parameters
whose master or Adam moments differ from zstack's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import _ds_fixture as fx  # type: ignore[import-not-found]


def train(engine: Any, data: list[torch.Tensor]) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for tokens in data:
        loss = engine(fx.local(tokens, rank, world))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def unequal(engine: Any, state: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """The states (``name/key``) DeepSpeed holds other than zstack saved (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = []
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        held = {"fp32": safe_get_full_fp32_param(p)}
        for key in ("exp_avg", "exp_avg_sq"):
            held[key] = safe_get_full_optimizer_state(p, key)
        for key, value in held.items():
            if not torch.equal(value.flatten(), state[name][key].flatten()):
                out.append(f"{name}/{key}")
    return out


def main() -> None:
    import deepspeed

    save_dir, job = Path(sys.argv[1]), Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    config = json.loads((job / "config.json").read_text())
    saved = torch.load(save_dir / "zstack.pt", weights_only=True)
    data = fx.batches(fx.STEPS_BEFORE + fx.STEPS_AFTER)

    def engine(cfg: dict[str, Any]) -> Any:
        m = fx.model()
        built, *_ = deepspeed.initialize(model=m, model_parameters=fx.param_groups(m), config=cfg)
        return built

    fresh = engine(config)
    fresh_losses = train(fresh, data)
    fresh.destroy()
    loaded = engine({**config, "checkpoint": {"load_universal": True}})
    _, client = loaded.load_checkpoint(str(save_dir))
    result = {
        "fresh": fresh_losses,
        "counters": [loaded.global_steps, loaded.global_samples],
        "lr": loaded.get_lr(),
        "client_epoch": client.get("epoch"),
        "unequal": unequal(loaded, saved["state"]),
    }
    result["continued"] = train(loaded, data[fx.STEPS_BEFORE :])
    loaded.destroy()
    if dist.get_rank() == 0:
        (job / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    dist.barrier()


if __name__ == "__main__":
    main()
