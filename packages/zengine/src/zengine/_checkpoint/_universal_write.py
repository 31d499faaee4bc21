"""A zengine checkpoint written as DeepSpeed's universal checkpoint: the way back to DeepSpeed.

`export_universal` reads a checkpoint of any world size and ZeRO stage offline, in one process,
and writes what DeepSpeed's ``ds_to_universal`` writes (see [Note: DeepSpeed's universal
checkpoint]): DeepSpeed then loads it at any world size and ZeRO stage with ``"checkpoint":
{"load_universal": true}``. The checkpoint already holds every tensor whole by parameter name
(see [Note: checkpoints keyed by parameter name]), so each output file is one tensor read by
`read_tensors` and written at once: host memory stays near one read batch (`budget` bytes, or
one tensor if larger), not the model. The folder is written as ``.<name>.partial`` beside `out`
and renamed to `out` only when every file is on disk (as our own saves: [Note: a checkpoint is
good or absent]); ``latest_universal`` is rewritten after that.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zengine._checkpoint import _files as files
from zengine._checkpoint._consolidate import DEFAULT_BUDGET, Entry, read_tensors
from zengine._checkpoint._dcp_read import SafeFileSystemReader, load_entries
from zengine._checkpoint._errors import CheckpointError, CorruptCheckpointError
from zengine._checkpoint._manifest import FORMAT
from zengine._checkpoint._pieces import PieceLoadPlanner
from zengine._checkpoint._state import ENGINE, PARAM_GROUPS, rank_key
from zengine._checkpoint._universal_layout import (
    LATEST_UNIVERSAL,
    MODEL_STATES,
    OPTIMIZER_STATE,
    ZERO,
    check_plain,
    model_states,
    optimizer_state,
    param_file,
)

__all__ = ["export_universal"]

log = logging.getLogger("zengine")

_STEP = "step"


def export_universal(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    latest: bool = False,
    verify: bool = True,
    budget: int = DEFAULT_BUDGET,
) -> Path:
    """Write `checkpoint` (a checkpoint directory, or the save_dir holding ``latest``; `tag`
    picks another) as DeepSpeed's universal checkpoint in `out_dir`, replacing an earlier
    export there; with `latest`, ``latest_universal`` beside it names it (what DeepSpeed's
    ``load_checkpoint`` reads when given no tag). With `verify` the checkpoint's files are
    first checked against their CRCs. Returns `out_dir`."""
    directory = _zstack_checkpoint(Path(checkpoint), tag)
    manifest = files.read_manifest(directory)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{directory / files.MANIFEST}: checkpoint format {manifest.get('format')!r}, this "
            f"zengine writes universal checkpoints of format {FORMAT}"
        )
    if verify:
        files.verify_checkpoint(directory, manifest)
    out = Path(out_dir)
    if out.exists() and not (out / ZERO / OPTIMIZER_STATE).is_file():
        raise CheckpointError(
            f"{out} exists and is not a universal checkpoint (no {ZERO}/{OPTIMIZER_STATE}): "
            "not replacing it"
        )
    start = time.perf_counter()
    partial = files.partial_dir(out.parent, out.name)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        files.remove_quietly(partial)
        (partial / ZERO).mkdir(parents=True)
        _write(directory, manifest, partial, budget)
        files.publish(partial, out)
    except BaseException:
        files.remove_quietly(partial)
        raise
    if latest:
        files.write_atomic(out.parent / LATEST_UNIVERSAL, out.name.encode())
    log.info(
        "zengine: wrote %s (DeepSpeed's universal checkpoint of %s) in %.2f s",
        out,
        directory,
        time.perf_counter() - start,
    )
    return out


def _zstack_checkpoint(root: Path, tag: str | None) -> Path:
    """The zstack checkpoint at `root`: itself, its tag `tag`, or the one ``latest`` names
    (never the DeepSpeed checkpoint a ``latest_universal`` beside it names: that is ours)."""
    if tag is None and (root / files.MANIFEST).exists():
        return root
    tag = tag if tag is not None else files.read_latest(root)
    if tag is None:
        raise CorruptCheckpointError(
            f"{root}: no checkpoint here (no {files.MANIFEST}, and no '{files.LATEST}' file "
            "naming a tag)"
        )
    return root / tag


class _Plan(NamedTuple):
    """What an export reads: the tensors in order (labelled by their ``zero/`` file, a buffer
    by its name), each trainable parameter's step-count key, and the buffers' names."""

    entries: list[Entry]
    steps: dict[str, str]
    buffers: set[str]


def _plan(directory: Path, manifest: dict[str, Any], metadata: dict[str, Any]) -> _Plan:
    states: dict[str, list[str]] = {}  # parameter -> its optimizer states' keys
    for key in metadata:
        if key.startswith("optim/") and key != PARAM_GROUPS:
            states.setdefault(key.removeprefix("optim/").rpartition("/")[0], []).append(key)
    plan = _Plan([], {}, set())
    for name, info in manifest["params"].items():
        shape = tuple(info["shape"])
        if info["group"] is None:  # frozen: its compute-dtype weights, as fp32
            plan.entries.append((f"{name}/fp32", f"model/{name}", torch.float32, shape))
            continue
        plan.entries.append((f"{name}/fp32", f"master/{name}", torch.float32, shape))
        numel = torch.Size(shape).numel()
        for key in sorted(states.get(name, [])):
            state, stored = key.rpartition("/")[2], metadata[key]
            if state == _STEP:
                plan.steps[name] = key
            elif isinstance(stored, TensorStorageMetadata) and tuple(stored.size) == (numel,):
                plan.entries.append((f"{name}/{state}", key, stored.properties.dtype, shape))
            else:
                raise CheckpointError(
                    f"{directory}: the optimizer state {state!r} of {name} is not one value per "
                    "element of the parameter: DeepSpeed's universal checkpoint holds only such "
                    "states (exp_avg, exp_avg_sq) and a step count"
                )
    for name, shape in manifest["buffers"].items():
        stored = metadata.get(f"model/{name}")  # none for a buffer without elements
        dtype = stored.properties.dtype if isinstance(stored, TensorStorageMetadata) else None
        plan.entries.append((name, f"model/{name}", dtype or torch.float32, tuple(shape)))
        plan.buffers.add(name)
    return plan


def _write(directory: Path, manifest: dict[str, Any], partial: Path, budget: int) -> None:
    zero = partial / ZERO
    plan = _plan(
        directory, manifest, SafeFileSystemReader(directory).read_metadata().state_dict_metadata
    )
    client = rank_key(0, "client_state")  # DeepSpeed has one client state: rank 0's
    objects = _read_objects(directory, [ENGINE, PARAM_GROUPS, client, *plan.steps.values()])
    buffers: dict[str, torch.Tensor] = {}  # small: kept for the model states
    for label, tensor in read_tensors(directory, plan.entries, budget):
        if label in plan.buffers:
            buffers[label] = tensor
        else:
            _save(param_file(tensor), zero / f"{label}.pt")
    step = _write_steps(directory, manifest["params"], plan.steps, objects, partial)
    opt = optimizer_state(objects[PARAM_GROUPS], step)
    check_plain(opt, str(zero / OPTIMIZER_STATE))
    _save(opt, zero / OPTIMIZER_STATE)
    states = model_states(manifest, objects[ENGINE], buffers, objects[client] or {})
    for name in MODEL_STATES:
        _save(states, partial / name)
    for folder in (*sorted(p for p in zero.iterdir() if p.is_dir()), zero):
        files._fsync_dir(folder)  # the renames and new files of each folder on disk, too


def _write_steps(
    directory: Path,
    params: dict[str, Any],
    steps: dict[str, str],
    values: dict[str, Any],
    partial: Path,
) -> int | None:
    """Each trainable parameter's ``step.pt``; the step count of the first group (DeepSpeed's
    ZeRO-3 keeps one for all). DeepSpeed's ZeRO 1-2 step a group as one tensor: a group whose
    parameters took different numbers of steps has no universal form."""
    by_group: dict[int, dict[str, int]] = {}
    for name, key in steps.items():
        value = values[key]
        count = int(value.item() if isinstance(value, torch.Tensor) else value)
        by_group.setdefault(params[name]["group"], {})[name] = count
        _save(count, partial / ZERO / name / f"{_STEP}.pt")
    for group, counts in by_group.items():
        if len(set(counts.values())) > 1:
            shown = ", ".join(f"{n}: {c}" for n, c in list(counts.items())[:8])
            raise CheckpointError(
                f"{directory}: the parameters of optimizer group {group} took different numbers "
                f"of steps ({shown}); DeepSpeed's universal checkpoint has one step per group"
            )
    return next(iter(by_group[min(by_group)].values())) if by_group else None


def _read_objects(directory: Path, keys: list[str]) -> dict[str, Any]:
    """What DCP stored whole (Python objects, 0-d tensors) under `keys`."""
    if not keys:
        return {}
    metadata = SafeFileSystemReader(directory).read_metadata().state_dict_metadata
    dest: dict[str, Any] = {}
    for key in keys:
        stored = metadata.get(key)
        if stored is None:
            raise CorruptCheckpointError(f"{directory}: the checkpoint has no entry {key!r}")
        if isinstance(stored, TensorStorageMetadata):
            dest[key] = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
        else:
            dest[key] = None  # an object: DCP puts it in
    load_entries(dest, directory, PieceLoadPlanner())
    return dest


def _save(value: Any, path: Path) -> None:
    """torch.save `value` to `path`, on disk (fsynced) before the folder is renamed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            torch.save(value, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        raise CheckpointError(f"cannot write {path}: {error}") from error
