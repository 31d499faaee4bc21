"""Checkpoints of a pipeline: each stage a checkpoint of its own, one ``latest`` for all.

Stage s saves its layers (and its data-parallel replicas' shards) as zengine saves any engine
(`zengine._checkpoint`), under ``save_dir/stage<s>/<tag>``, without a ``latest`` of its own.
Once every stage's save succeeded, which all ranks agree on, world rank 0 writes
``save_dir/latest``; a stage that failed fails the save on every stage, and ``latest`` keeps
naming the previous checkpoint, whole on every stage. A load reads that tag on every stage.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

import zcomm
from zengine import _checkpoint_files as files
from zengine._checkpoint_errors import CheckpointError

__all__ = ["load_checkpoint", "save_checkpoint"]

log = logging.getLogger("zengine")


def _stage_dir(root: Path, stage: int) -> Path:
    return root / f"stage{stage}"


def _failed_stages(engine: Any, failed: bool) -> list[int]:
    """Every stage that failed, as every rank sees it (one all-gather over the world)."""
    # on the engine's device: NCCL gathers only device tensors
    flags = torch.zeros(zcomm.get_world_size(), dtype=torch.int64, device=engine.device)
    mine = torch.tensor([engine.stage_id + 1 if failed else 0], device=engine.device)
    zcomm.all_gather_into_tensor(flags, mine)
    return sorted({int(f) - 1 for f in flags.tolist() if f})


def save_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike[str],
    tag: str | None,
    client_state: dict[str, Any] | None,
    save_latest: bool,
) -> bool:
    from zengine import _checkpoint  # torch.distributed.checkpoint: a second to import

    root = Path(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    error: BaseException | None = None
    try:
        _checkpoint.save_checkpoint(
            engine, _stage_dir(root, engine.stage_id), tag, client_state, save_latest=False
        )
    except Exception as exc:  # reported to every stage below, then raised here
        error = exc
    failed = _failed_stages(engine, error is not None)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(
            f"save_checkpoint({str(root)!r}, tag={tag!r}): stage(s) {failed} failed to save; "
            f"'{files.LATEST}' still names the previous checkpoint"
        )
    if save_latest and zcomm.get_rank() == 0:
        files.write_atomic(root / files.LATEST, tag.encode())
    zcomm.barrier()  # 'latest' is written before anyone goes on
    return True


def load_checkpoint(
    engine: Any,
    load_dir: str | os.PathLike[str],
    tag: str | None,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
) -> tuple[str | None, dict[str, Any] | None]:
    from zengine import _checkpoint  # torch.distributed.checkpoint: a second to import

    root = Path(load_dir)
    if tag is None:
        tag = files.read_latest(root)
        if tag is None:
            log.warning("zengine: no '%s' file in %s: no checkpoint loaded", files.LATEST, root)
            return None, None
    return _checkpoint.load_checkpoint(
        engine,
        _stage_dir(root, engine.stage_id),
        tag,
        load_optimizer_states,
        load_lr_scheduler_states,
    )
