"""A partitioned parameter: DeepSpeed's ``ds_*`` attributes on an ordinary ``nn.Parameter``.

Transformers, PEFT and Accelerate detect ZeRO-3 parameters by these attributes, so they are
plain attributes of the same Parameter object the model and the optimizer hold: ``ds_id``,
``ds_status``, ``ds_numel``, ``ds_shape``, ``ds_tensor`` (this rank's chunk, 1-D), ``ds_persist``,
``ds_active_sub_modules``, and the methods ``all_gather()``, ``partition()`` and ``ds_summary()``.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
from torch import nn

from zpartition._status import ZeroParamStatus

__all__ = ["convert_parameter", "next_module_id", "summary"]

_module_ids = itertools.count()  # ids of users of units: local to this process


def next_module_id() -> int:
    """A fresh id for a module (or a context) that gathers parameters."""
    return next(_module_ids)


def chunk_of(data: torch.Tensor, rank: int, world: int, device: torch.device) -> torch.Tensor:
    """This rank's chunk of `data` flattened: ceil(n / world) elements, zero-padded at the end."""
    numel = data.numel()
    chunk = math.ceil(numel / world)
    out = torch.zeros(chunk, dtype=data.dtype, device=device)
    start, stop = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
    out[: stop - start].copy_(data.reshape(-1)[start:stop])
    return out


def convert_parameter(
    param: nn.Parameter,
    *,
    ds_id: int,
    rank: int,
    world: int,
    shard_device: torch.device,
    compute_device: torch.device,
    dtype: torch.dtype | None = None,
) -> None:
    """Keep this rank's chunk of `param` (already equal on every rank) and empty its data."""
    data = param.data if dtype is None or not param.is_floating_point() else param.data.to(dtype)
    param.ds_id = ds_id
    param.ds_numel = data.numel()
    param.ds_shape = data.shape
    param.ds_tensor = chunk_of(data, rank, world, shard_device)
    param.ds_persist = False
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    param.ds_active_sub_modules = set()
    param.ds_unit = None
    param.data = torch.empty(0, dtype=data.dtype, device=compute_device)
    param.all_gather = functools.partial(_all_gather, param)
    param.partition = functools.partial(_partition, param)
    param.ds_summary = functools.partial(summary, param)


def _all_gather(param: nn.Parameter, param_list: list[nn.Parameter] | None = None) -> None:
    from zpartition._gather import gather_now  # a cycle: gathering needs units, units params

    gather_now(param_list if param_list is not None else [param])


def _partition(param: nn.Parameter, param_list: list[nn.Parameter] | None = None) -> None:
    from zpartition._gather import release_now

    release_now(param_list if param_list is not None else [param])


def summary(param: nn.Parameter) -> dict[str, Any]:
    """What DeepSpeed's ``ds_summary()`` shows: the payload of most ZeRO-3 error messages."""
    grad = param.grad
    return {
        "id": param.ds_id,
        "status": param.ds_status.name,
        "numel": param.numel(),
        "ds_numel": param.ds_numel,
        "shape": tuple(param.shape),
        "ds_shape": tuple(param.ds_shape),
        "requires_grad": param.requires_grad,
        "grad_shape": tuple(grad.shape) if grad is not None else None,
        "persist": param.ds_persist,
        "active_sub_modules": sorted(param.ds_active_sub_modules),
        "ds_tensor.shape": tuple(param.ds_tensor.shape),
        "unit": param.ds_unit.name if param.ds_unit is not None else None,
    }
