"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``: a checkpoint's model as one fp32 state dict.

``from zengine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint`` stands in
for DeepSpeed's import. A checkpoint (zstack's, a pipeline engine's, or DeepSpeed's) is read in
one process without torch.distributed, whatever world size and ZeRO stage wrote it (see
zengine/_checkpoint/_consolidate.py). The command line is DeepSpeed's: ``python -m
zengine.utils.zero_to_fp32 CKPT OUTPUT_DIR [--safe_serialization] [--max_shard_size 5GB] [-t
TAG] [--exclude_frozen_parameters] [-d]``, which the ``zero_to_fp32.py`` that
``save_checkpoint`` writes into every save_dir runs (as ``python zero_to_fp32.py . OUT``), and
``python -m deepspeed.utils.zero_to_fp32`` with the compatibility package. ``zengine
consolidate CKPT FILE`` writes one file.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from zengine._checkpoint import (
    CheckpointError,
    Entry,
    consolidate_shards,
    fp32_state_dict,
    open_model,
    read_tensors,
)

__all__ = [
    "LazyTensor",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
]

_M = TypeVar("_M", bound=nn.Module)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


class LazyTensor:
    """One tensor of a checkpoint, read when ``contiguous()`` is called (``lazy_mode``)."""

    def __init__(self, directory: Path, entry: Entry) -> None:
        self._directory = directory
        self._entry = entry
        self.dtype = entry[2]
        self.shape = torch.Size(entry[3])

    def contiguous(self) -> torch.Tensor:
        [(_, tensor)] = read_tensors(self._directory, [self._entry], budget=0)
        return tensor

    def __repr__(self) -> str:
        return f"LazyTensor({self._entry[0]!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> Mapping[str, torch.Tensor | LazyTensor]:
    """The model of the checkpoint in `checkpoint_dir` (the tag ``latest`` names, or `tag`) as
    one fp32 state dict on the host. Tied weights come under each of their names, as one
    tensor. With `lazy_mode` each value is a `LazyTensor`, read by its ``contiguous()``."""
    if not lazy_mode:
        return fp32_state_dict(
            checkpoint_dir, tag=tag, exclude_frozen_parameters=exclude_frozen_parameters
        )
    contents = open_model(checkpoint_dir, tag, exclude_frozen_parameters)
    out: dict[str, torch.Tensor | LazyTensor] = {}
    for entry in contents.entries:
        lazy = LazyTensor(contents.directory_of(entry[0]), entry)
        out.update(dict.fromkeys([entry[0], *contents.aliases.get(entry[0], [])], lazy))
    return out


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write the checkpoint's fp32 model into `output_dir` as DeepSpeed does:
    ``pytorch_model.bin`` (``model.safetensors`` with `safe_serialization`), or shards of at
    most `max_shard_size` (``"5GB"``, ``"500MiB"`` or bytes; None: one file) and their index,
    named as Hugging Face names them. Streams: host memory holds a batch of tensors at a time.
    Tied weights: every name in a torch file (one storage), the first in a safetensors file,
    which cannot share (DeepSpeed's safetensors save refuses them; Hugging Face keeps one)."""
    consolidate_shards(
        checkpoint_dir,
        output_dir,
        max_shard_bytes=None if max_shard_size is None else _bytes(max_shard_size),
        safetensors=safe_serialization,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def load_state_dict_from_zero_checkpoint(
    model: _M, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> _M:
    """Move `model` to the host and load the checkpoint's fp32 weights into it (not strict, as
    DeepSpeed's); returns the model. It is no longer partitioned or hooked by an engine."""
    state = fp32_state_dict(checkpoint_dir, tag=tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def _bytes(size: int | str) -> int:
    """A size as Hugging Face writes it ("5GB" is 5 * 10**9 bytes, "5GiB" 5 * 2**30)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
    if isinstance(size, bool) or match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"max_shard_size: expected a positive number of bytes or a size such as '5GB' or "
            f"'500MiB', got {size!r}"
        )
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _parser() -> argparse.ArgumentParser:
    """DeepSpeed 0.19.8's arguments of its zero_to_fp32.py, with its defaults."""
    parser = argparse.ArgumentParser(
        prog="zero_to_fp32.py",
        description="Write a checkpoint's model (zstack's, a pipeline engine's, or DeepSpeed's, "
        "any world size and ZeRO stage) as an fp32 state dict that loads without the engine: "
        "OUTPUT_DIR/pytorch_model.bin, or model.safetensors, or shards and their index.",
    )
    parser.add_argument(
        "checkpoint_dir",
        help="the checkpoint folder, e.g. path/checkpoint-12 (the save_dir holding 'latest'), "
        "or one tag's folder",
    )
    parser.add_argument(
        "output_dir", help="the folder to write the state dict files into (created if missing)"
    )
    parser.add_argument(
        "--max_shard_size",
        default="5GB",
        help="the largest a file may be before the state dict is split into shards and an "
        "index, e.g. 5GB (10**9 bytes) or 500MiB (default: %(default)s)",
    )
    parser.add_argument(
        "--safe_serialization",
        action="store_true",
        help="write safetensors (model.safetensors) instead of torch.save's pickle files",
    )
    parser.add_argument(
        "-t", "--tag", default=None, help="the tag to read, e.g. global_step1 (default: latest)"
    )
    parser.add_argument(
        "--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters"
    )
    parser.add_argument("-d", "--debug", action="store_true", help="log every tensor read")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """DeepSpeed's ``zero_to_fp32.py`` command line; the exit status (1 with the problem said
    on stderr for a folder that holds no readable checkpoint or a bad size)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("zengine").setLevel(logging.DEBUG if args.debug else logging.INFO)
    try:
        written = consolidate_shards(
            args.checkpoint_dir,
            args.output_dir,
            max_shard_bytes=_bytes(args.max_shard_size),
            safetensors=args.safe_serialization,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except (CheckpointError, OSError, ValueError) as error:
        print(f"zero_to_fp32: {error}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
