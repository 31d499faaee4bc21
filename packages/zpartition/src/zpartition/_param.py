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
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from zpartition._status import ZeroParamStatus

if TYPE_CHECKING:
    import torch.distributed as dist

    from zpartition._channel import Channel

__all__ = [
    "UnitView",
    "ZeroParameter",
    "convert_parameter",
    "next_module_id",
    "partitioned",
    "summary",
    "zero_params",
]


class UnitView(Protocol):
    """A parameter's unit (``param.ds_unit``, a `zpartition._unit.Unit`) as those holding the
    parameter or its shard (`zpartition._shard`) read it. Declared here, with the parameter:
    the unit module imports this one."""

    @property
    def name(self) -> str: ...
    @property
    def params(self) -> list[ZeroParameter]: ...
    @property
    def channel(self) -> Channel: ...
    @property
    def replicate(self) -> dist.ProcessGroup | None: ...
    @property
    def persistent(self) -> bool: ...
    @property
    def users(self) -> set[int]: ...  # ids of the modules that hold it gathered
    @property
    def status(self) -> ZeroParamStatus: ...
    @property
    def shard(self) -> torch.Tensor: ...
    @property
    def journal(self) -> list[ZeroParameter] | None: ...  # where shard writes are recorded
    def bring_in(self) -> None: ...
    def put_away(self) -> None: ...


if TYPE_CHECKING:

    class ZeroParameter(nn.Parameter):
        """A Parameter with what partitioning adds, for the type checker: at run time it is the
        same ``nn.Parameter`` object, carrying these as attributes."""

        ds_id: int
        ds_numel: int
        ds_shape: torch.Size
        ds_tensor: torch.Tensor
        ds_persist: bool
        ds_status: ZeroParamStatus
        ds_active_sub_modules: set[int]
        ds_unit: UnitView | None
        ds_name: str
        ds_z3_leaf_module: nn.Module

        def all_gather(self, param_list: list[ZeroParameter] | None = None) -> None: ...
        def partition(self, param_list: list[ZeroParameter] | None = None) -> None: ...
        def ds_summary(self) -> dict[str, Any]: ...

else:
    ZeroParameter = nn.Parameter


def zero_params(params: Iterable[torch.Tensor]) -> list[ZeroParameter]:
    """`params` as partitioned parameters (the caller knows they are)."""
    return cast("list[ZeroParameter]", list(params))


def partitioned(params: Iterable[torch.Tensor]) -> list[ZeroParameter]:
    """Those of `params` that are partitioned: a model's parameters without elements are
    left whole, as DeepSpeed leaves them (there is nothing to cut, gather or reduce)."""
    return zero_params(p for p in params if hasattr(p, "ds_id"))


_module_ids = itertools.count()  # ids of users of units: local to this process


def next_module_id() -> int:
    """A fresh id for a module (or a context) that gathers parameters."""
    return next(_module_ids)


def chunk_of(
    data: torch.Tensor, rank: int, world: int, device: torch.device, pin: bool = False
) -> torch.Tensor:
    """This rank's chunk of `data` flattened: ceil(n / world) elements, zero-padded at the end
    (in pinned host memory with `pin`)."""
    numel = data.numel()
    chunk = math.ceil(numel / world)
    out = torch.zeros(chunk, dtype=data.dtype, device=device, pin_memory=pin)
    start, stop = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
    out[: stop - start].copy_(data.reshape(-1)[start:stop])
    return out


def convert_parameter(
    param: ZeroParameter,
    *,
    ds_id: int,
    rank: int,
    world: int,
    shard_device: torch.device,
    compute_device: torch.device,
    dtype: torch.dtype | None = None,
    pin: bool = False,
) -> None:
    """Keep this rank's chunk of `param` (already equal on every rank; pinned with `pin`) and
    empty its data."""
    data = param.data if dtype is None or not param.is_floating_point() else param.data.to(dtype)
    param.ds_id = ds_id
    param.ds_numel = data.numel()
    param.ds_shape = data.shape
    param.ds_tensor = chunk_of(data, rank, world, shard_device, pin)
    param.ds_persist = False
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    param.ds_active_sub_modules = set()
    param.ds_unit = None
    param.data = torch.empty(0, dtype=data.dtype, device=compute_device)
    # bound like a method, as DeepSpeed's is; all_gather() and partition() are bound by
    # `zpartition._gather.bind_gather_methods`, which owns gathering (units sit between)
    param.__dict__["ds_summary"] = functools.partial(summary, param)


def summary(param: ZeroParameter) -> dict[str, Any]:
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
