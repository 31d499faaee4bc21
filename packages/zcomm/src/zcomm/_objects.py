"""Picklable objects gathered from every rank, without NumPy.

torch's ``all_gather_object`` unpickles through ``tensor.numpy()``, so on a machine without
NumPy (torch does not require it) it fails with "Numpy is not available". This sends the
pickles as byte tensors through `all_gather_into_tensor`: one gather of the sizes, one of the
bytes padded to the longest. Only for objects a rank of the same job made: unpickling runs what
they name, as with torch's.
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist

from zcomm._collectives import all_gather_into_tensor

__all__ = ["all_gather_object"]


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(
    object_list: list[Any], obj: Any, group: dist.ProcessGroup | None = None
) -> None:
    """torch's ``all_gather_object``: `object_list` (one slot per rank of `group`) gets every
    rank's `obj`, in rank order. A collective: every rank of `group` calls it."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if len(object_list) != world:
        raise ValueError(
            f"all_gather_object: object_list has {len(object_list)} slots, the group {world} ranks"
        )
    if world == 1:
        object_list[0] = obj
        return
    data = pickle.dumps(obj)
    device = _device(group)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    all_gather_into_tensor(sizes, torch.tensor([len(data)], device=device), group=group)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(world * longest, dtype=torch.uint8, device=device)
    all_gather_into_tensor(out, padded.to(device), group=group)
    out = out.cpu()
    base = out.data_ptr()
    for rank, size in enumerate(sizes.tolist()):
        object_list[rank] = pickle.loads(ctypes.string_at(base + rank * longest, int(size)))
