"""A Hugging Face style safetensors checkpoint loaded into a module, partitioned (ZeRO-3) or not,
each rank reading only the bytes of its own shards (`zengine.load_safetensors` is the verb).

[Note: each rank reads its own bytes]
Transformers under DeepSpeed ZeRO-3 has rank 0 read the whole checkpoint and broadcast it one
module at a time (``GatheredParameters(modifier_rank=0)``). Here every rank maps the files and
copies out only its chunk of each partitioned parameter: elements
``[rank * c, min((rank + 1) * c, n))`` of the flattened tensor, c = ceil(n / world) for the world
of the parameter's unit (see `chunk_of` in zpartition), straight into ``ds_tensor``. Nothing is
broadcast and no rank holds a tensor it does not own; the only collective is one flag, so that
a checkpoint one rank cannot read stops every rank instead of leaving the others waiting in
the next collective. Parameters gathered now (persistent ones) also get their full value, and
those not partitioned (without elements, or an unpartitioned model) and buffers are read whole.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

import zcomm
import zpartition
from zengine._checkpoint._errors import CheckpointError, CheckpointMismatchError
from zengine._checkpoint._safetensors import Entry, MappedFile
from zengine._checkpoint._safetensors_checkpoint import checkpoint_entries, resolve

__all__ = ["load_safetensors_into"]

log = logging.getLogger("zengine")

_LOUD_BYTES = 1 << 30  # checkpoints at least this large log a line per file on rank 0


@dataclass
class _Target:
    """One tensor of the model: a parameter (maybe partitioned) or a buffer, and its names in
    the state dict (several for a tied weight)."""

    tensor: torch.Tensor
    names: list[str] = field(default_factory=list)


def _state_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What ``module.state_dict(keep_vars=True)`` holds, in its order, without reading a
    partitioned parameter's data."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                yield dot + name, p
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                yield dot + name, b


def _targets(module: nn.Module) -> list[_Target]:
    by_id: dict[int, _Target] = {}
    for name, tensor in _state_tensors(module):
        by_id.setdefault(id(tensor), _Target(tensor)).names.append(name)
    return list(by_id.values())


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


@dataclass
class _Plan:
    copies: list[tuple[Entry, torch.Tensor]]  # in file and byte order
    missing: list[str]  # the model's names not loaded: absent, or of another shape
    absent: list[str]  # those not in the checkpoint
    unexpected: list[str]  # the checkpoint's names not in the model
    mismatched: list[str]  # a line per tensor of another shape


def _plan(targets: list[_Target], entries: dict[str, Entry]) -> _Plan:
    plan = _Plan([], [], [], [], [])
    used: set[str] = set()
    for target in targets:
        present = [n for n in target.names if n in entries]
        used.update(present)
        if not present:  # a tied weight is found under any one of its names
            plan.missing += target.names
            plan.absent += target.names
            continue
        entry = entries[present[-1]]  # load_state_dict copies each name: the last one wins
        if entry.shape != _shape(target.tensor):
            plan.missing.append(target.names[0])
            plan.mismatched.append(
                f"{entry.name} in {entry.path}: checkpoint shape {entry.shape}, "
                f"model shape {_shape(target.tensor)}"
            )
            continue
        plan.copies.append((entry, target.tensor))
    order = {name: i for i, name in enumerate(entries)}  # files in turn, each in byte order
    plan.copies.sort(key=lambda c: order[c[0].name])
    plan.unexpected = [n for n in entries if n not in used]
    return plan


def _check(plan: _Plan, where: Path, module: nn.Module, strict: bool) -> None:
    """Raise, with `strict`, for whatever does not fit, all of it at once; warn of tensors of
    another shape without."""
    problems = []
    if strict and plan.absent:
        problems.append("missing from the checkpoint: " + ", ".join(map(repr, plan.absent)))
    if strict and plan.unexpected:
        problems.append("not in the model: " + ", ".join(map(repr, plan.unexpected)))
    problems += plan.mismatched
    if not problems:
        return
    message = f"{where} does not fit {type(module).__name__}:\n  " + "\n  ".join(problems)
    if strict:
        raise CheckpointMismatchError(f"load_safetensors: {message}")
    warnings.warn(f"load_safetensors: not loaded, as {message}", stacklevel=4)


def _units(targets: list[_Target]) -> list[zpartition.Unit]:
    """The units of the model's partitioned parameters, after checking their layout is the
    one `_copy_shard` reads: ceil(n / world) elements a rank."""
    found: dict[int, zpartition.Unit] = {}
    for target in targets:
        if not hasattr(target.tensor, "ds_tensor"):
            continue
        param: zpartition.ZeroParameter = target.tensor  # type: ignore[assignment]
        unit = getattr(param, "ds_unit", None)
        world = unit.channel.size if unit is not None else 0
        if unit is None or param.ds_tensor.numel() != -(-int(param.ds_numel) // world):
            raise TypeError(
                f"load_safetensors: {target.names[0]} is partitioned in a layout it does not "
                "know (a shard of ceil(numel / world) elements in a zpartition unit)"
            )
        found.setdefault(id(unit), unit)
    return list(found.values())


# ---------------------------------------------------------------------------------------------
# Copying


def _copy_whole(mapped: MappedFile, entry: Entry, dst: torch.Tensor) -> None:
    if dst.is_contiguous():
        mapped.copy_into(entry, 0, dst.view(-1))
        return
    flat = torch.empty(entry.numel, dtype=dst.dtype, device=dst.device)
    mapped.copy_into(entry, 0, flat)
    dst.copy_(flat.view(dst.shape))


def _copy_shard(mapped: MappedFile, entry: Entry, param: zpartition.ZeroParameter) -> None:
    channel = param.ds_unit.channel  # type: ignore[union-attr]  # _units checked it has one
    numel, chunk = int(param.ds_numel), param.ds_tensor.numel()
    start = min(channel.rank * chunk, numel)
    stop = min(start + chunk, numel)
    mapped.copy_into(entry, start, param.ds_tensor[: stop - start])
    gathered = param.data.numel() == numel and param.data.data_ptr() != param.ds_tensor.data_ptr()
    if gathered:  # a persistent parameter, or one gathered now: its full value too
        _copy_whole(mapped, entry, param.data)


def _copy_all(plan: _Plan, units: list[zpartition.Unit], loud: bool) -> None:
    for u in units:  # on NVMe, or kept as codes: shards must be in memory to be written
        u.bring_in()
    files = list(dict.fromkeys(entry.path for entry, _ in plan.copies))
    mapped: MappedFile | None = None
    try:
        with torch.no_grad():
            for entry, tensor in plan.copies:
                if mapped is None or mapped.path != entry.path:
                    mapped = _next_file(mapped, entry.path, files, loud)
                if hasattr(tensor, "ds_tensor"):
                    _copy_shard(mapped, entry, tensor)  # type: ignore[arg-type]
                else:
                    _copy_whole(mapped, entry, tensor.detach())
    finally:
        if mapped is not None:
            mapped.close()
    for u in units:
        if u.status is zpartition.ZeroParamStatus.NOT_AVAILABLE:
            u.put_away()


def _next_file(mapped: MappedFile | None, path: Path, files: list[Path], loud: bool) -> MappedFile:
    if mapped is not None:
        mapped.close()
    if loud:
        size = path.stat().st_size / 2**30
        log.info(
            "zengine: reading %s (%d/%d, %.1f GiB)",
            path.name,
            files.index(path) + 1,
            len(files),
            size,
        )
    return MappedFile(path)


# ---------------------------------------------------------------------------------------------
# Ranks


def _channel(units: list[zpartition.Unit]) -> Any:
    return units[0].channel if units else None


def _agree(failed: bool, channel: Any) -> None:
    """Every rank of the model's group learns whether any could not read the checkpoint."""
    if channel is None or channel.size == 1:
        return
    flag = torch.tensor([int(failed)], device=channel.device)
    zcomm.all_reduce(flag, op=zcomm.ReduceOp.MAX, group=channel.group)
    if flag.item() and not failed:
        raise CheckpointError(
            "load_safetensors: another rank could not read the checkpoint (its error says why); "
            "nothing was loaded"
        )


def _is_first(channel: Any) -> bool:
    if channel is not None:
        return bool(channel.rank == 0)
    return not zcomm.is_initialized() or zcomm.get_rank() == 0


def load_safetensors_into(
    module: nn.Module, checkpoint: str | os.PathLike[str], strict: bool
) -> _IncompatibleKeys:
    """Load `checkpoint` into `module` (see `zengine.load_safetensors`); every rank of the
    module's groups must call it."""
    started = time.perf_counter()
    targets = _targets(module)
    units = _units(targets)
    channel = _channel(units)
    try:
        where = resolve(checkpoint)
        entries = checkpoint_entries(where)
        plan = _plan(targets, entries)
        _check(plan, where, module, strict)
    except Exception:
        _agree(True, channel)
        raise
    _agree(False, channel)
    total = sum(e.numel * e.dtype.itemsize for e in entries.values())
    loud = total >= _LOUD_BYTES and _is_first(channel)
    _copy_all(plan, units, loud)
    (log.info if loud else log.debug)(
        "zengine: loaded %d tensors (%.2f GiB) from %s in %.1f s",
        len(plan.copies),
        total / 2**30,
        where,
        time.perf_counter() - started,
    )
    return _IncompatibleKeys(plan.missing, plan.unexpected)
