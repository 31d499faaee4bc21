"""Which files a Hugging Face style safetensors checkpoint is, and which tensor lies where.

A checkpoint is one ``model.safetensors``, or Transformers' sharded form: shard files and
``model.safetensors.index.json``, whose ``weight_map`` names each tensor's shard. It may be
given as the file, the index, or the directory holding either (the index wins, as in
``from_pretrained``). Only headers are read here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from zengine._checkpoint._errors import CorruptCheckpointError
from zengine._checkpoint._safetensors import Entry, read_header

__all__ = ["checkpoint_entries", "resolve"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def resolve(checkpoint: str | os.PathLike[str]) -> Path:
    """The file to read: `checkpoint` itself, or the index or single file in that directory."""
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"no safetensors checkpoint at {path}: it does not exist")
    if not path.is_dir():
        return path
    for name in (INDEX, SINGLE):
        if (path / name).is_file():
            return path / name
    for pattern in ("*.safetensors.index.json", "*.safetensors"):  # another name, if only one
        found = sorted(path.glob(pattern))
        if len(found) == 1:
            return found[0]
    raise FileNotFoundError(
        f"no {SINGLE} or {INDEX} in {path} (nor exactly one other *.safetensors or "
        "*.safetensors.index.json): pass the file to load"
    )


def checkpoint_entries(path: Path) -> dict[str, Entry]:
    """Every tensor of the checkpoint `path` (a safetensors file or an index json), by name,
    file by file in the order of their bytes."""
    if path.name.endswith(".json"):
        return _indexed(path)
    return read_header(path)


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as error:
        raise CorruptCheckpointError(f"{index}: not a safetensors index ({error})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpointError(f"{index}: no weight_map of tensor names to shard files")
    return weight_map


def _indexed(index: Path) -> dict[str, Entry]:
    weight_map = _weight_map(index)
    entries: dict[str, Entry] = {}
    for file in sorted(set(weight_map.values())):
        shard = index.parent / file
        if not shard.is_file():
            raise CorruptCheckpointError(f"{index}: its shard {shard} does not exist")
        header = read_header(shard)
        for name, where in weight_map.items():
            if where == file and name not in header:
                raise CorruptCheckpointError(
                    f"{index}: {name!r} is to be in {shard}, whose header does not have it"
                )
        for name, entry in header.items():  # a shard's tensors the map omits count too
            if weight_map.get(name, file) == file:
                entries.setdefault(name, entry)
    return entries
