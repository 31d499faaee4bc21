"""``zengine consolidate CKPT OUT``: one fp32 state dict from a sharded checkpoint, offline.

The checkpoint holds every parameter's master weights as chunks of the flattened parameter
(see [Note: checkpoints keyed by parameter name]), so a parameter is rebuilt by reading its
chunks, whatever world size wrote them, in a single process without torch.distributed. A
DeepSpeed checkpoint (its own layout or a universal one) is read the same way, by parameter
name, through `DeepSpeedCheckpoint` ([Note: reading DeepSpeed's layouts]). A pipeline
engine's checkpoint (one per stage, _stages.py) is read stage after stage, as one model: a
PipelineModule names its parameters by global layer index, and a tied weight, saved by every
stage that holds it, is read from the lowest.

[Note: streaming consolidation]
Parameters are read a batch at a time (at most `budget` bytes of fp32, or one parameter if it
is larger) and written out before the next batch is read, so host memory stays near one batch,
not the model. The output's layout is known before any data is read (names, shapes, dtypes
from the manifest): a safetensors file is a header followed by the data; a torch.save file is
first written with ``torch.serialization.skip_data`` (the whole zip with its pickle and empty
storage records) and then each storage's bytes are written at its record's offset.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zengine._checkpoint import _files as files
from zengine._checkpoint._dcp_read import SafeFileSystemReader, load_entries
from zengine._checkpoint._ds_checkpoint import DeepSpeedCheckpoint
from zengine._checkpoint._ds_files import is_deepspeed
from zengine._checkpoint._errors import CorruptCheckpointError
from zengine._checkpoint._manifest import check_format
from zengine._checkpoint._pieces import Piece, PieceLoadPlanner
from zengine._checkpoint._safetensors import SafetensorsWriter, write_tensor
from zengine._checkpoint._stage_layout import read_layout, stage_dir

__all__ = [
    "Entry",
    "consolidate",
    "consolidate_shards",
    "contents_of",
    "fp32_state_dict",
    "iter_fp32",
    "open_model",
    "read_tensors",
]

log = logging.getLogger("zengine")

DEFAULT_BUDGET = 256 << 20  # bytes of fp32 read at a time

Entry = tuple[str, str, torch.dtype, tuple[int, ...]]  # output name, checkpoint key, dtype, shape


@dataclasses.dataclass
class _Contents:
    """What a consolidated state dict of one checkpoint holds."""

    entries: list[Entry]  # each tensor once, in model order
    aliases: dict[str, list[str]]  # an entry's name -> the other names of the same parameter
    where: Path  # the checkpoint directory its entries are read from
    stages: dict[str, Path] = dataclasses.field(default_factory=dict)  # a pipeline's: by name

    def directory_of(self, name: str) -> Path:
        return self.stages.get(name, self.where)


def _deepspeed_contents(ck: DeepSpeedCheckpoint, exclude_frozen: bool) -> _Contents:
    """A DeepSpeed checkpoint's tensors in its module's order: the trainable parameters' fp32
    masters, the frozen parameters (as saved, in fp32) and the buffers."""
    params, frozen, buffers = ck.params, ck.frozen(), ck.buffers()
    if ck.zero_stage == 0 and not params and not ck.universal:
        log.warning(
            "zengine: %s is a ZeRO stage-0 checkpoint, which does not say which parameters its "
            "fp32 masters are of: its module's weights are used, in the dtype they were saved",
            ck.directory,
        )
    module = list(ck.model_states.get("module") or {})
    order = list(dict.fromkeys([*module, *params, *frozen, *buffers]))
    entries: list[Entry] = []
    for name in order:
        if name in params:
            entries.append((name, f"master/{name}", torch.float32, params[name].shape))
        elif name in frozen and not exclude_frozen:
            entries.append((name, f"model/{name}", torch.float32, frozen[name]))
        elif name in buffers:
            dtype = buffers[name].dtype
            out_dtype = torch.float32 if dtype.is_floating_point else dtype
            entries.append((name, f"model/{name}", out_dtype, tuple(buffers[name].shape)))
    kept = {e[0] for e in entries}
    aliases: dict[str, list[str]] = {}
    for other, name in ck.shared().items():
        if name in kept:
            aliases.setdefault(name, []).append(other)
    return _Contents(entries, aliases, ck.directory)


def contents_of(directory: Path, exclude_frozen: bool = False) -> _Contents:
    """What the checkpoint in `directory` (zstack's or DeepSpeed's) holds, in model order."""
    if is_deepspeed(directory):
        return _deepspeed_contents(DeepSpeedCheckpoint(directory), exclude_frozen)
    manifest = files.read_manifest(directory)
    check_format(manifest, str(directory))
    files.verify_checkpoint(directory, manifest)  # what load_checkpoint checks, before reading
    metadata = SafeFileSystemReader(directory).read_metadata().state_dict_metadata
    entries: list[Entry] = []
    for name, info in manifest["params"].items():
        if exclude_frozen and info["group"] is None:
            continue
        key = f"master/{name}" if info["group"] is not None else f"model/{name}"
        entries.append((name, key, torch.float32, tuple(info["shape"])))
    for name, shape in manifest["buffers"].items():
        stored = metadata.get(f"model/{name}")  # none for a buffer without elements
        dtype = torch.float32 if stored is None else stored.properties.dtype  # type: ignore[union-attr]
        out_dtype = torch.float32 if dtype.is_floating_point else dtype
        entries.append((name, f"model/{name}", out_dtype, tuple(shape)))
    kept = {e[0] for e in entries}
    aliases: dict[str, list[str]] = {}
    for other, name in manifest.get("shared", {}).items():  # older checkpoints: none recorded
        if name in kept:
            aliases.setdefault(name, []).append(other)
    return _Contents(entries, aliases, directory)


def _pipeline_stages(root: Path, tag: str | None) -> list[Path] | None:
    """The stage directories of a pipeline engine's checkpoint in `root` (its tag `tag` or
    the one ``latest`` names); None if `root` holds none."""
    if (root / files.MANIFEST).exists() or not stage_dir(root, 0).is_dir():
        return None
    tag = tag if tag is not None else files.read_latest(root)
    if tag is None:
        return None
    layout = read_layout(root, tag)
    if layout is not None:
        return [stage_dir(root, s) / tag for s in range(layout.stages)]
    stages: list[Path] = []  # saved before pipeline-<tag>.json existed: every stage<s> in a row
    while stage_dir(root, len(stages)).is_dir():
        stages.append(stage_dir(root, len(stages)) / tag)
    return stages


def open_model(
    checkpoint: str | os.PathLike[str], tag: str | None = None, exclude_frozen: bool = False
) -> _Contents:
    """What the checkpoint `checkpoint` (a checkpoint directory, or a save_dir and its tag
    `tag` or ``latest``'s) holds: zstack's, a pipeline engine's (its stages, as one model) or
    DeepSpeed's."""
    root = Path(checkpoint)
    stages = _pipeline_stages(root, tag)
    if stages is None:
        return contents_of(files.resolve(checkpoint, tag), exclude_frozen)
    merged = _Contents([], {}, root / (tag or files.read_latest(root) or ""))
    for directory in stages:
        contents = contents_of(directory, exclude_frozen)
        for entry in contents.entries:
            if entry[0] not in merged.stages:  # a tied weight: the lowest stage's
                merged.entries.append(entry)
                merged.stages[entry[0]] = directory
        for name, others in contents.aliases.items():
            known = merged.aliases.setdefault(name, [])
            known.extend(o for o in others if o not in known)
    return merged


def read_model(
    contents: _Contents, entries: list[Entry], budget: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """`read_tensors` of `entries`, each from its own directory (a pipeline's stage)."""
    runs: list[list[Entry]] = []
    for entry in entries:
        if not runs or contents.directory_of(entry[0]) != contents.directory_of(runs[-1][0][0]):
            runs.append([])
        runs[-1].append(entry)
    for run in runs:
        for name, tensor in read_tensors(contents.directory_of(run[0][0]), run, budget):
            log.debug("zengine: read %s %s %s", name, tuple(tensor.shape), tensor.dtype)
            yield name, tensor


def _batches(entries: list[Entry], budget: int) -> Iterator[list[Entry]]:
    batch: list[Entry] = []
    size = 0
    for entry in entries:
        nbytes = torch.Size(entry[3]).numel() * 4
        if batch and size + nbytes > budget:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += nbytes
    if batch:
        yield batch


def read_tensors(
    directory: Path, entries: list[Entry], budget: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """`entries`' tensors, in their order, read a batch of at most `budget` bytes at a time
    (a DeepSpeed checkpoint: a tensor at a time, from its mapped files)."""
    if is_deepspeed(directory):
        ck = DeepSpeedCheckpoint(directory)
        for name, key, dtype, shape in entries:
            tensor = ck.read_key(key, 0, torch.Size(shape).numel())
            if tensor is None:
                raise CorruptCheckpointError(f"{directory} holds no {key!r}")
            yield name, tensor.to(dtype).view(shape)
        return
    metadata = SafeFileSystemReader(directory).read_metadata().state_dict_metadata
    for batch in _batches(entries, budget):
        dest: dict[str, Any] = {}
        for _, key, _, shape in batch:
            numel = torch.Size(shape).numel()
            if numel == 0:  # never written (DCP has no chunk to store)
                dest[key] = Piece(torch.empty(0), 0, 0)
                continue
            stored = metadata[key]
            dtype = stored.properties.dtype  # type: ignore[union-attr]
            dest[key] = Piece(torch.empty(numel, dtype=dtype), 0, numel)
        load_entries(dest, directory, PieceLoadPlanner())
        for name, key, dtype, shape in batch:
            yield name, dest.pop(key).data.to(dtype).view(shape)


def iter_fp32(
    checkpoint: str | os.PathLike[str],
    *,
    tag: str | None = None,
    budget: int = DEFAULT_BUDGET,
    exclude_frozen_parameters: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter (fp32) and buffer of a checkpoint, in model order, a batch at a time; a
    parameter under several names (tied weights) comes under each, the same tensor."""
    contents = open_model(checkpoint, tag, exclude_frozen_parameters)
    for name, tensor in read_model(contents, contents.entries, budget):
        yield name, tensor
        for other in contents.aliases.get(name, []):
            yield other, tensor


def fp32_state_dict(
    checkpoint: str | os.PathLike[str],
    *,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> dict[str, torch.Tensor]:
    """The whole model's fp32 state dict, in memory (DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``)."""
    return dict(iter_fp32(checkpoint, tag=tag, exclude_frozen_parameters=exclude_frozen_parameters))


def _torch_save_layout(
    path: Path, entries: list[Entry], aliases: dict[str, list[str]]
) -> dict[str, int]:
    """Write a torch.save file with empty storages, an alias sharing its entry's; the file
    offset of each entry's bytes."""
    with FakeTensorMode():
        fake = {}
        for name, _, dtype, shape in entries:
            fake[name] = torch.empty(shape, dtype=dtype)
            fake.update(dict.fromkeys(aliases.get(name, []), fake[name]))
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(fake, path)
    # Loading with mmap maps every storage to its record's place in the file: a storage's
    # address minus the mapping's start is its offset. The start is the one that puts every
    # storage at the offset of some record.
    mapped = torch.load(path, mmap=True, weights_only=True)
    reader = torch._C.PyTorchFileReader(str(path))
    records = [r for r in reader.get_all_records() if r.startswith("data/")]
    offsets = {reader.get_record_offset(r) for r in records}  # type: ignore[attr-defined]
    addresses = {name: t.untyped_storage().data_ptr() for name, t in mapped.items() if t.numel()}
    del mapped
    if not addresses:
        return {}
    low = min(addresses.values())
    for first in sorted(offsets):
        base = low - first
        if all(a - base in offsets for a in addresses.values()):
            return {name: a - base for name, a in addresses.items()}
    raise RuntimeError(f"{path}: cannot locate the storages of the torch.save file")


def consolidate(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tag: str | None = None,
    budget: int = DEFAULT_BUDGET,
    exclude_frozen_parameters: bool = False,
) -> Path:
    """Write `checkpoint`'s model as one fp32 state dict: safetensors if `out` ends in
    ``.safetensors``, else a ``torch.load``-able file. Streams (see [Note: streaming
    consolidation]). Tied weights: a torch.save file has every name, sharing one storage; a
    safetensors file, which cannot share, has the first name only (as Hugging Face saves)."""
    contents = open_model(checkpoint, tag, exclude_frozen_parameters)
    _log_start(contents, out)
    start = time.perf_counter()
    target = _write(Path(out), contents, contents.entries, budget)
    log.info("zengine: wrote %s in %.1f s", target, time.perf_counter() - start)
    return target


def consolidate_shards(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int | None,
    safetensors: bool = False,
    tag: str | None = None,
    budget: int = DEFAULT_BUDGET,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write `checkpoint`'s model into `out_dir` as DeepSpeed's zero_to_fp32 and Hugging Face
    lay out a model's weights: ``pytorch_model.bin`` (or ``model.safetensors``), or, past
    `max_shard_bytes`, shards ``pytorch_model-00001-of-0000N.bin``... and an index
    ``pytorch_model.bin.index.json`` naming each tensor's shard (see `_shards`). Returns the
    files written, index last."""
    contents = open_model(checkpoint, tag, exclude_frozen_parameters)
    stem, suffix = ("model", ".safetensors") if safetensors else ("pytorch_model", ".bin")
    shards = _shards(contents.entries, max_shard_bytes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _log_start(contents, out)
    written, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = (
            f"{stem}{suffix}"
            if len(shards) == 1
            else f"{stem}-{i:05d}-of-{len(shards):05d}{suffix}"
        )
        written.append(_write(out / name, contents, shard, budget))
        for entry in shard:
            aliases = [] if safetensors else contents.aliases.get(entry[0], [])
            weight_map.update({n: name for n in (entry[0], *aliases)})
    if len(shards) > 1:
        total = sum(torch.Size(e[3]).numel() * e[2].itemsize for e in contents.entries)
        index = out / f"{stem}{suffix}.index.json"
        index.write_text(
            json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map},
                indent=2,
                sort_keys=True,  # as DeepSpeed writes it
            )
            + "\n"
        )
        written.append(index)
    return written


def _shards(entries: list[Entry], max_bytes: int | None) -> list[list[Entry]]:
    """`entries` split as huggingface_hub's ``split_torch_state_dict_into_shards`` splits a
    state dict (DeepSpeed's zero_to_fp32 calls it): in order, a shard closed when the next
    tensor would take it past `max_bytes`; a tensor larger than `max_bytes` gets a shard of its
    own, placed where it closes, while the open shard stays open for the tensors after it."""
    if max_bytes is None:
        return [entries]
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for entry in entries:
        nbytes = torch.Size(entry[3]).numel() * entry[2].itemsize
        if nbytes > max_bytes:
            shards.append([entry])
            continue
        if size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _log_start(contents: _Contents, out: str | os.PathLike[str]) -> None:
    entries = contents.entries
    log.info(
        "zengine: consolidating %s%s (%d tensors, %d elements) into %s",
        contents.where,
        f" ({len(set(contents.stages.values()))} pipeline stages)" if contents.stages else "",
        len(entries),
        sum(torch.Size(e[3]).numel() for e in entries),
        out,
    )


def _write(target: Path, contents: _Contents, entries: list[Entry], budget: int) -> Path:
    """One file of `entries` (safetensors by its suffix, else torch.save), streamed."""
    tensors = read_model(contents, entries, budget)
    if target.suffix == ".safetensors":
        writer = SafetensorsWriter(target, [(n, d, s) for n, _, d, s in entries], {"format": "pt"})
        for name, tensor in tensors:
            writer.write(name, tensor)
        writer.close()
    else:
        _stream_torch_save(target, entries, contents.aliases, tensors)
    return target


def _stream_torch_save(
    target: Path,
    entries: list[Entry],
    aliases: dict[str, list[str]],
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")  # see SafetensorsWriter
    offsets = _torch_save_layout(tmp, entries, aliases)
    with open(tmp, "r+b") as f:
        for name, tensor in tensors:
            if name in offsets:
                f.seek(offsets[name])
                write_tensor(f, tensor)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
