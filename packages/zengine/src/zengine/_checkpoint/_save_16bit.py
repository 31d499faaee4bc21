"""``engine.save_16bit_model``: the whole model in its compute dtype, one file, from rank 0.

At stage 3 no rank holds the whole model, so it is gathered one module at a time (each
module's own parameters, then released), and only with
``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (DeepSpeed's switch: the
gathered model must fit in rank 0's host memory). Every rank must call it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

import zpartition
from zengine._checkpoint._engine_view import CheckpointEngine
from zengine._checkpoint._safetensors import SafetensorsWriter
from zengine._checkpoint._state import persistent_buffers
from zengine._checkpoint._sync import Sync

__all__ = ["gathered_state", "save_16bit_model"]

log = logging.getLogger("zengine")


def gathered_state(
    engine: CheckpointEngine, rank: int, exclude_frozen: bool
) -> dict[str, torch.Tensor]:
    """The module's parameters (gathered module by module at stage 3) and buffers, on the
    host, on rank 0; empty elsewhere. A parameter under several names (tied weights) is
    gathered once and comes under each name, one tensor (as DeepSpeed's)."""
    state: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}  # id(param) -> the name it was gathered under
    for prefix, module in engine.module.named_modules(remove_duplicate=False):
        named = [
            (f"{prefix}.{name}" if prefix else name, p)
            for name, p in module.named_parameters(recurse=False)
            if p.requires_grad or not exclude_frozen
        ]
        own = [(name, p) for name, p in named if first.setdefault(id(p), name) == name]
        with zpartition.GatheredParameters([p for _, p in own], modifier_rank=None):
            if rank == 0:
                for name, p in own:
                    state[name] = p.data.detach().to("cpu", copy=True)
        if rank == 0:
            state.update((name, state[first[id(p)]]) for name, p in named if first[id(p)] != name)
    if rank == 0:
        for name, buf in persistent_buffers(engine.module):
            state[name] = buf.detach().to("cpu", copy=True)
    return state


def _write(path: Path, state: dict[str, torch.Tensor]) -> None:
    if path.suffix == ".safetensors":
        # a tensor under several names is written under the first (safetensors cannot share)
        once = {id(v): (k, v) for k, v in reversed(state.items())}
        kept = {k: v for k, v in state.items() if once[id(v)][0] == k}
        writer = SafetensorsWriter(
            path, [(k, v.dtype, v.shape) for k, v in kept.items()], {"format": "pt"}
        )
        for k, v in kept.items():
            writer.write(k, v)
        writer.close()
        return
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_16bit_model(
    engine: CheckpointEngine,
    save_dir: str | os.PathLike[str],
    save_filename: str = "pytorch_model.bin",
    *,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write ``save_dir/save_filename`` on rank 0 (safetensors when it ends in
    ``.safetensors``); False, with a warning, at stage 3 without the gather switch."""
    zero = engine.config.zero_optimization
    if engine.zero_optimization_stage() == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
        log.warning(
            "zengine: save_16bit_model did not save: at ZeRO stage 3 it needs "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save: true"
        )
        return False
    sync = Sync(engine.group, engine.config.checkpoint.timeout)
    sync.arrive("save_16bit_model")
    state = gathered_state(engine, sync.rank, exclude_frozen_parameters)
    path = Path(save_dir) / save_filename
    error = None
    if sync.rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write(path, state)
        except OSError as exc:
            error = f"cannot write {path}: {exc}"
        log.info("zengine: saved the 16-bit model to %s", path)
    sync.agree("save_16bit_model", error)
    return True
