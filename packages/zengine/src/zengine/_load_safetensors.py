"""`load_safetensors`: a Hugging Face style safetensors checkpoint into a model, a ZeRO-3 model or
an engine.

The reading, each rank only the bytes of its own shards, is the checkpoint package's
(_checkpoint/_safetensors_load.py); here an engine's module is what is loaded, and its
optimizer's masters are taken from it after.
"""

from __future__ import annotations

import os

from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

import zpartition
from zengine._checkpoint import load_safetensors_into
from zengine._engine import Engine

__all__ = ["load_safetensors"]


def load_safetensors(
    model: nn.Module | Engine | zpartition.Partitioned,
    checkpoint: str | os.PathLike[str],
    *,
    strict: bool = True,
) -> _IncompatibleKeys:
    """Load a Hugging Face style safetensors checkpoint into `model`, partitioned or not.

    `checkpoint` is a ``.safetensors`` file, a ``model.safetensors.index.json`` (Transformers'
    shards), or a directory holding either. Into a ZeRO-3 model (``zpartition.Init``,
    ``zpartition.partition``, a stage-3 engine) each rank reads, memory-mapped, only the bytes
    of its own shards. Checkpoint tensors are converted to the model's dtypes; a tied weight
    stored under one of its names is loaded under all. Given an `Engine`, its module is
    loaded and the optimizer's fp32 masters taken from it (``refresh_fp32_params``), so the
    next step starts from the loaded weights.

    Returns ``(missing_keys, unexpected_keys)`` as ``load_state_dict``. With `strict`, missing
    or unexpected tensors and tensors of another shape raise `CheckpointMismatchError` naming
    them (and the file and both shapes) before anything is loaded; without, they are skipped,
    a tensor of another shape with a warning and among the missing keys. A missing file raises
    ``FileNotFoundError``, a damaged one `CorruptCheckpointError`, both naming the file. Every
    rank of the model's group must call it.
    """
    module = model.module if isinstance(model, (Engine, zpartition.Partitioned)) else model
    result = load_safetensors_into(module, checkpoint, strict)
    if isinstance(model, Engine) and model.optimizer is not None:
        model.optimizer.refresh_fp32_params()
    return result
