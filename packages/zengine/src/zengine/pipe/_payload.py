"""What travels between stages: any nest of tuples, lists and dicts with tensors at the leaves.

A payload is flattened (torch's pytree) into its tensors and a `Meta`: the structure, the
non-tensor leaves, and each tensor's dtype and shape. The receiver needs the meta to allocate
its buffers; both ends keep the last one per channel, so it is sent only when it changes.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["Meta", "flatten", "grad_slots", "unflatten"]


@dataclass(frozen=True)
class Meta:
    """The shape of a payload without its data; equal metas allocate equal buffers."""

    spec: str  # the tree structure, as pytree serializes it
    leaves: tuple[Any, ...]  # per leaf: (dtype, shape) for a tensor, ("value", v) otherwise

    def tensor_slots(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """Each tensor's dtype and shape, in order."""
        return [leaf for leaf in self.leaves if isinstance(leaf[0], torch.dtype)]

    def encode(self) -> torch.Tensor:
        """The meta as a uint8 tensor, to send."""
        data = pickle.dumps((self.spec, self.leaves))
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    @staticmethod
    def decode(data: torch.Tensor) -> Meta:
        """The meta `encode` made (sent by the peer stage of this job)."""
        spec, leaves = pickle.loads(bytes(data.tolist()))
        return Meta(spec, leaves)


def flatten(payload: Any) -> tuple[list[torch.Tensor], Meta]:
    """The payload's tensors (contiguous, detached) and its meta."""
    values, spec = pytree.tree_flatten(payload)
    tensors: list[torch.Tensor] = []
    leaves: list[Any] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().contiguous())
            leaves.append((value.dtype, tuple(value.shape)))
        else:
            leaves.append(("value", value))
    return tensors, Meta(pytree.treespec_dumps(spec), tuple(leaves))


def unflatten(tensors: list[torch.Tensor], meta: Meta) -> Any:
    """The payload `flatten` took apart, from its tensors and meta."""
    it = iter(tensors)
    values = [next(it) if isinstance(leaf[0], torch.dtype) else leaf[1] for leaf in meta.leaves]
    return pytree.tree_unflatten(values, pytree.treespec_loads(meta.spec))


def grad_slots(meta: Meta) -> list[int]:
    """Which tensors of a payload carry a gradient back: the floating-point ones."""
    return [i for i, (dtype, _) in enumerate(meta.tensor_slots()) if dtype.is_floating_point]
