"""Noticing that an optimizer changed shards, whatever optimizer it is.

A persistent unit is gathered again when its shards' version counter moved since its last
gather (`Unit.refresh`). In-place ops move it, but torch's fused optimizer kernels
(``fused=True``) write without moving it; so after every optimizer step (torch's global
post-step hook) the shards it stepped are marked as changed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["watch"]

_shards: dict[int, weakref.ref[torch.Tensor]] = {}  # id(shard view) -> it, while alive
_hooked = False


def watch(shard: torch.Tensor) -> None:
    """Mark `shard` (a ``ds_tensor``) as changed after any optimizer step that steps it."""
    global _hooked
    key = id(shard)
    _shards[key] = weakref.ref(shard, lambda _: _shards.pop(key, None))
    if not _hooked:
        register_optimizer_step_post_hook(_after_step)
        _hooked = True


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stepped: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        params = group["params"]
        # looked up in C: an optimizer over zengine's fp32 masters steps no shard at all
        found = list(map(_shards.get, map(id, params)))
        if not any(found):
            continue
        for p, ref in zip(params, found, strict=True):
            shard = ref() if ref is not None else None
            if shard is not None and shard is p:
                stepped.append(shard)
    if stepped:
        increment_version(stepped)
