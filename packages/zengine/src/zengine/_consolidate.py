"""``zengine consolidate CKPT OUT``: one fp32 state dict from a sharded checkpoint, offline.

The checkpoint holds every parameter's master weights as chunks of the flattened parameter
(see [Note: checkpoints keyed by parameter name]), so a parameter is rebuilt by reading its
chunks, whatever world size wrote them, in a single process without torch.distributed.

[Note: streaming consolidation]
Parameters are read a batch at a time (at most `budget` bytes of fp32, or one parameter if it
is larger) and written out before the next batch is read, so host memory stays near one batch,
not the model. The output's layout is known before any data is read (names, shapes, dtypes
from the manifest): a safetensors file is a header followed by the data; a torch.save file is
first written with ``torch.serialization.skip_data`` (the whole zip with its pickle and empty
storage records) and then each storage's bytes are written at its record's offset.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from zengine import _checkpoint_files as files
from zengine._checkpoint_pieces import Piece, PieceLoadPlanner
from zengine._safetensors import SafetensorsWriter, write_tensor

__all__ = ["consolidate", "fp32_state_dict", "iter_fp32"]

log = logging.getLogger("zengine")

DEFAULT_BUDGET = 256 << 20  # bytes of fp32 read at a time


def _entries(directory: Path) -> list[tuple[str, str, torch.dtype, tuple[int, ...]]]:
    """(output name, checkpoint key, output dtype, shape) of everything a state dict holds."""
    manifest = files.read_manifest(directory)
    metadata = FileSystemReader(directory).read_metadata().state_dict_metadata
    out = []
    for name, info in manifest["params"].items():
        key = f"master/{name}" if info["group"] is not None else f"model/{name}"
        out.append((name, key, torch.float32, tuple(info["shape"])))
    for name, shape in manifest["buffers"].items():
        stored = metadata[f"model/{name}"]
        dtype = stored.properties.dtype  # type: ignore[union-attr]
        out.append(
            (
                name,
                f"model/{name}",
                torch.float32 if dtype.is_floating_point else dtype,
                tuple(shape),
            )
        )
    return out


def _batches(
    entries: list[tuple[str, str, torch.dtype, tuple[int, ...]]], budget: int
) -> Iterator[list[tuple[str, str, torch.dtype, tuple[int, ...]]]]:
    batch: list[tuple[str, str, torch.dtype, tuple[int, ...]]] = []
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


def iter_fp32(
    checkpoint: str | os.PathLike[str], *, tag: str | None = None, budget: int = DEFAULT_BUDGET
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter (fp32) and buffer of a checkpoint, in model order, a batch at a time."""
    directory = files.resolve(checkpoint, tag)
    reader = FileSystemReader(directory)
    metadata = reader.read_metadata().state_dict_metadata
    for batch in _batches(_entries(directory), budget):
        dest: dict[str, Any] = {}
        for _, key, _, shape in batch:
            stored = metadata[key]
            numel = torch.Size(shape).numel()
            dtype = stored.properties.dtype  # type: ignore[union-attr]
            dest[key] = Piece(torch.empty(numel, dtype=dtype), 0, numel)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(dest, storage_reader=reader, planner=PieceLoadPlanner(), no_dist=True)
        for name, key, dtype, shape in batch:
            yield name, dest.pop(key).data.to(dtype).view(shape)


def fp32_state_dict(
    checkpoint: str | os.PathLike[str], *, tag: str | None = None
) -> dict[str, torch.Tensor]:
    """The whole model's fp32 state dict, in memory (DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``)."""
    return dict(iter_fp32(checkpoint, tag=tag))


def _torch_save_layout(
    path: Path, entries: list[tuple[str, str, torch.dtype, tuple[int, ...]]]
) -> dict[str, int]:
    """Write a torch.save file with empty storages; the file offset of each entry's bytes."""
    with FakeTensorMode():
        fake = {name: torch.empty(shape, dtype=dtype) for name, _, dtype, shape in entries}
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
) -> Path:
    """Write `checkpoint`'s model as one fp32 state dict: safetensors if `out` ends in
    ``.safetensors``, else a ``torch.load``-able file. Streams (see [Note: streaming
    consolidation])."""
    directory = files.resolve(checkpoint, tag)
    entries = _entries(directory)
    target = Path(out)
    start, total = time.perf_counter(), sum(torch.Size(e[3]).numel() for e in entries)
    log.info(
        "zengine: consolidating %s (%d parameters, %d elements) into %s",
        directory,
        len(entries),
        total,
        target,
    )
    tensors = iter_fp32(directory, budget=budget)
    if target.suffix == ".safetensors":
        writer = SafetensorsWriter(target, [(n, d, s) for n, _, d, s in entries], {"format": "pt"})
        for name, tensor in tensors:
            writer.write(name, tensor)
        writer.close()
    else:
        _stream_torch_save(target, entries, tensors)
    log.info("zengine: wrote %s in %.1f s", target, time.perf_counter() - start)
    return target


def _stream_torch_save(
    target: Path,
    entries: list[tuple[str, str, torch.dtype, tuple[int, ...]]],
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    offsets = _torch_save_layout(tmp, entries)
    with open(tmp, "r+b") as f:
        for name, tensor in tensors:
            if name in offsets:
                f.seek(offsets[name])
                write_tensor(f, tensor)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
