"""``engine.load_checkpoint`` of a folder DeepSpeed saved: a run continues on zstack.

The checkpoint is read by parameter name (`DeepSpeedCheckpoint`), so it loads at any world size
and ZeRO stage, as zstack's own checkpoints do: each rank fills its own pieces of the masters,
of the optimizer state and of the frozen parameters and buffers (the same `model_entries` and
`optimizer_destinations` that a zstack load reads into), from whichever of DeepSpeed's rank
files hold them. Then, as DeepSpeed's own load: the optimizer's group options, the step
counters, the loss scaler, the LR scheduler and the client state. DeepSpeed saves no RNG state;
the RNGs stay as they are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from zengine._checkpoint._ds_checkpoint import DeepSpeedCheckpoint
from zengine._checkpoint._ds_pipeline import DeepSpeedPipelineCheckpoint
from zengine._checkpoint._engine_view import CheckpointEngine
from zengine._checkpoint._errors import CheckpointError, CorruptCheckpointError
from zengine._checkpoint._manifest import FORMAT, check, describe
from zengine._checkpoint._options import LoadOptions
from zengine._checkpoint._pieces import Piece
from zengine._checkpoint._state import (
    PARAM_GROUPS,
    after_load,
    apply_engine_state,
    apply_optimizer_objects,
    frozen_shards_in_memory,
    model_entries,
    optimizer_destinations,
    optimizer_of,
)
from zengine._checkpoint._sync import Sync

__all__ = ["Source", "describe_deepspeed", "group_names", "load_deepspeed"]

log = logging.getLogger("zengine")


def group_names(engine: CheckpointEngine) -> list[list[str]]:
    """The trainable parameters' names in each optimizer group, in the optimizer's order."""
    if engine.optimizer is None:
        return []
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return [[names[id(p)] for p in params] for params in engine.optimizer.layout.params]


Source = DeepSpeedCheckpoint | DeepSpeedPipelineCheckpoint


def describe_deepspeed(
    ck: Source, engine: CheckpointEngine, only: Collection[str] | None = None
) -> dict[str, Any]:
    """What `ck` is of, as zstack's manifest says it (see `_manifest.describe`), to be checked
    against the engine with the same errors; of the names in `only`, if given (a pipeline
    stage's, checked against the whole pipeline elsewhere)."""
    now = describe(engine)
    params: dict[str, Any] = {
        name: {"shape": list(p.shape), "dtype": "float32", "group": p.group}
        for name, p in ck.params.items()
    }
    for name, shape in ck.frozen().items():
        params[name] = {"shape": list(shape), "dtype": "float32", "group": None}
    buffers = {name: list(b.shape) for name, b in ck.buffers().items()}
    if only is not None:
        params = {n: v for n, v in params.items() if n in only}
        buffers = {n: v for n, v in buffers.items() if n in only}
    scaler = ck.loss_scaler()
    return {
        "format": FORMAT,
        "world_size": ck.world_size,
        "zero_stage": ck.zero_stage,
        "loss_scaler": now["loss_scaler"] if scaler is not None else None,
        "optimizer": now["optimizer"],  # DeepSpeed does not record its optimizer's class
        "param_groups": len(ck.param_groups()) if ck.param_groups() else now["param_groups"],
        "params": params,
        "buffers": buffers,
        "shared": ck.shared(),
        "frozen_excluded": False,
    }


def _fill(entries: dict[str, Any], ck: Source) -> None:
    """Each piece and tensor of `entries`, read from the checkpoint straight into it."""
    for key, value in entries.items():
        if isinstance(value, Piece):
            data, offset = value.data, value.offset
        elif isinstance(value, torch.Tensor) and value.dim() == 1:
            data, offset = value, 0
        else:
            continue
        if data.numel():
            ck.read_key(key, offset, offset + data.numel(), out=data)


def _stored(ck: Source) -> dict[str, STORAGE_TYPES]:
    """The optimizer state the checkpoint holds, as DCP metadata by zstack's keys: the state
    the engine's optimizer lacks (a fresh engine) is made in these shapes."""
    fp32 = TensorProperties(dtype=torch.float32)
    stored: dict[str, STORAGE_TYPES] = {}
    kinds = ck.state_kinds()
    for name, param in ck.params.items():
        for kind in kinds:
            size = torch.Size([param.numel])
            chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=size)
            stored[f"optim/{name}/{kind}"] = TensorStorageMetadata(fp32, size, [chunk])
        if kinds and ck.step_of(name) is not None:
            stored[f"optim/{name}/step"] = TensorStorageMetadata(fp32, torch.Size([]), [])
    return stored


def _steps(ck: Source, entries: dict[str, Any]) -> dict[str, Any]:
    """Each parameter's step count into its optimizer state (a 0-d tensor is written in place;
    a number is returned, for `apply_optimizer_objects`)."""
    objects: dict[str, Any] = {}
    for key, value in entries.items():
        if not key.endswith("/step") or not key.startswith("optim/"):
            continue
        step = ck.step_of(key.removeprefix("optim/").removesuffix("/step"))
        if step is None:
            continue
        if isinstance(value, torch.Tensor):
            value.fill_(step)
        else:
            objects[key] = step
    return objects


def _param_group_options(engine: CheckpointEngine, ck: Source) -> list[dict[str, Any]]:
    """DeepSpeed's saved group options that the engine's optimizer also has (its "lr",
    "betas"...; not FusedAdam's own "bias_correction")."""
    groups = optimizer_of(engine).param_groups
    saved = ck.param_groups() or [{} for _ in groups]
    return [{k: v for k, v in s.items() if k in g} for s, g in zip(saved, groups, strict=True)]


def _scaler_state(engine: CheckpointEngine, ck: Source) -> dict[str, Any] | None:
    scaler = optimizer_of(engine).loss_scaler
    saved = ck.loss_scaler()
    if scaler is None or saved is None:
        return None
    # a static scaler in the checkpoint into a dynamic one: its other counters stay as they are
    return {**scaler.state_dict(), **{k: v for k, v in saved.items() if k in scaler.state_dict()}}


def load_deepspeed(
    engine: CheckpointEngine,
    sync: Sync,
    directory: Path,
    options: LoadOptions,
    *,
    checkpoint: DeepSpeedPipelineCheckpoint | None = None,
    only: Collection[str] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Load DeepSpeed's checkpoint `directory` into `engine` (every rank of its data-parallel
    group; see the module doc) as `options` say (their directory and tag are resolved into
    `directory` already). A pipeline's stage passes the `checkpoint` every stage reads and its
    own names, `only`."""
    forward_only = engine.optimizer is None
    load_optimizer_states = options.load_optimizer_states
    start = time.perf_counter()
    ck: Source | None = checkpoint
    error: CheckpointError | None = None
    try:
        if ck is None:  # a pipeline's folder is refused, by name, for an engine of one stage
            ck = DeepSpeedCheckpoint(directory, group_names(engine))
        check(
            describe_deepspeed(ck, engine, only),
            engine,
            where=f"{directory} (DeepSpeed's)",
            optimizer=load_optimizer_states,
            strict=options.load_module_strict,
        )
    except CheckpointError as exc:
        error = exc
    sync.agree(f"load_checkpoint({str(directory)!r})", error)
    assert ck is not None
    log.info(
        "zengine: loading DeepSpeed checkpoint %s (ZeRO stage %d, %d ranks)",
        directory,
        ck.zero_stage,
        ck.world_size,
    )
    objects: dict[str, Any] = {}
    failure = None
    try:
        with frozen_shards_in_memory(engine), torch.no_grad():
            entries: dict[str, Any] = dict(model_entries(engine, saved_masters=ck.params))
            if load_optimizer_states:
                entries.update(optimizer_destinations(engine, _stored(ck)))
            _fill(entries, ck)
            if load_optimizer_states:
                objects = _steps(ck, entries)
    except (CheckpointError, OSError, KeyError, IndexError, RuntimeError) as exc:
        failure = f"{type(exc).__name__}: {exc}"
    sync.agree(f"load_checkpoint({str(directory)!r}): reading", failure, CorruptCheckpointError)
    after_load(engine)
    if load_optimizer_states:
        apply_optimizer_objects(engine, {PARAM_GROUPS: _param_group_options(engine, ck), **objects})
    if not (options.load_module_only or forward_only):
        counters = ck.counters()
        steps = counters["global_steps"]
        state = {
            **counters,
            "micro_steps": steps * engine.gradient_accumulation_steps(),
            "loss_scaler": _scaler_state(engine, ck),
            "lr_scheduler": ck.model_states.get("lr_scheduler"),
        }
        apply_engine_state(engine, state, scheduler=options.load_lr_scheduler_states)
    log.info("zengine: loaded %s in %.2f s", directory, time.perf_counter() - start)
    return str(directory), ck.client_state()
