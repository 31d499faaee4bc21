"""Splitting a list of layers into contiguous parts: by parameters, uniformly, by type, or as given.

A partition is DeepSpeed's ``parts`` list: ``parts[i]`` to ``parts[i + 1]`` are the layers of
part ``i`` (a part is a stage, or a chunk of one), so it has one more entry than parts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from zengine.pipe._specs import LayerSpec

__all__ = ["layer_name", "partition_balanced", "partition_layers", "partition_uniform"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal numbers of items per part; the first parts take one more when it does not divide
    (DeepSpeed's rule)."""
    size, extra = divmod(num_items, num_parts)
    parts = [0]
    for i in range(num_parts):
        parts.append(parts[-1] + size + (1 if i < extra else 0))
    return parts


def _fits(weights: Sequence[int], num_parts: int, limit: int) -> list[int] | None:
    """Parts of at most `limit` each, filled greedily from the left but leaving an item for
    every later part (no part is empty when there are enough items); None if impossible."""
    parts, total, n = [0], 0, len(weights)
    for i, w in enumerate(weights):
        unopened = num_parts - len(parts)
        if parts[-1] < i and unopened > 0 and (total + w > limit or n - i <= unopened):
            parts.append(i)
            total = 0
        total += w
        if total > limit:
            return None
    return parts + [n] * (num_parts + 1 - len(parts))


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Contiguous parts whose heaviest part is as light as possible (a binary search on that
    weight; each trial a greedy fill)."""
    lo, hi = max(weights, default=0), max(sum(weights), 0)
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(weights, num_parts, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    found = _fits(weights, num_parts, lo)
    assert found is not None  # the sum always fits
    return found


def layer_name(layer: object) -> str:
    """The class name a ``type:`` partition matches: the spec's class, the module's, or the
    callable's name."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return str(getattr(layer, "__name__", type(layer).__name__))


def _trainable(layer: object) -> int:
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # counted without allocating or touching the RNG state
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _explicit(parts: Sequence[int], num_layers: int, num_parts: int) -> list[int]:
    bounds = list(parts)
    if len(bounds) != num_parts + 1:
        raise ValueError(
            f"PipelineModule(partition_method=...): {num_parts} parts need {num_parts + 1} "
            f"boundaries, got {len(bounds)}: {bounds}"
        )
    if bounds[0] != 0 or bounds[-1] != num_layers or bounds != sorted(bounds):
        raise ValueError(
            f"PipelineModule(partition_method=...): boundaries must rise from 0 to the "
            f"number of layers ({num_layers}), got {bounds}"
        )
    return bounds


def partition_layers(
    layers: Sequence[object], num_parts: int, method: str | Sequence[int]
) -> list[int]:
    """The ``parts`` list of `layers` split `num_parts` ways by `method`: ``parameters``
    (trainable parameters), ``uniform`` (layer count), ``type:REGEX`` (layers whose class
    name matches, case-insensitively), or a list of boundaries."""
    if not isinstance(method, str):
        return _explicit(method, len(layers), num_parts)
    lowered = method.lower()
    if lowered == "uniform":
        return partition_uniform(len(layers), num_parts)
    if lowered == "parameters":
        return partition_balanced([_trainable(layer) for layer in layers], num_parts)
    if lowered.startswith("type:"):
        pattern = re.compile(method[5:], re.IGNORECASE)
        weights = [1 if pattern.search(layer_name(layer)) else 0 for layer in layers]
        if not any(weights):
            raise ValueError(
                f"PipelineModule(partition_method={method!r}): no layer's class name matches "
                f"{method[5:]!r}; the layers are {sorted({layer_name(x) for x in layers})}"
            )
        return partition_balanced(weights, num_parts)
    raise ValueError(
        f"PipelineModule(partition_method={method!r}): expected 'parameters', 'uniform', "
        "'type:REGEX' or a list of boundaries"
    )
