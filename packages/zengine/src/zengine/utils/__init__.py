"""DeepSpeed's ``safe_get_*`` / ``safe_set_*``: a parameter's fp32 master, gradient and
optimizer state, this rank's piece (``local``) or the whole (``full``, every rank must call);
and its logging helpers (``logger``, ``log_dist``, ``print_dist``, ``see_memory_usage``).

A parameter's piece lives in the ZeRO optimizer's flat partitions (see [Note: flat partitions]
in _optim/_partitions.py). Parameters the optimizer does not hold (frozen ones) give None.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

import torch

import zcomm
from zengine._optim import Fragment, ZeroOptimizer
from zengine.utils._logging import log_dist, logger, print_dist, see_memory_usage

__all__ = [
    "RepeatingLoader",
    "log_dist",
    "logger",
    "print_dist",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "see_memory_usage",
]


def _owner(param: torch.Tensor) -> tuple[ZeroOptimizer, Fragment] | None:
    optimizer = param.__dict__.get("_zengine_optimizer")
    if optimizer is None:
        return None
    frag = optimizer.partitions.fragments.get(id(param))
    # with NVMe offload the masters and state may be on disk between steps: read them back
    return None if frag is None else (optimizer.resident(), frag)


def _state_of(optimizer: ZeroOptimizer, param: torch.Tensor, key: str) -> torch.Tensor:
    found = optimizer.partitions.state_key(param)
    frag = optimizer.partitions.fragments[id(param)]
    assert found is not None
    tensor, offset = found
    state = optimizer.optimizer.state.get(tensor, {})
    if key not in state:
        raise KeyError(
            f"safe_get_*_optimizer_state: no optimizer state {key!r} (there is: "
            f"{sorted(state) or 'none yet: step the optimizer first'})"
        )
    value: torch.Tensor = state[key]
    return value.reshape(-1)[offset : offset + frag.numel]


def _local(param: torch.Tensor, what: str, key: str = "") -> torch.Tensor | None:
    owner = _owner(param)
    if owner is None:
        return None
    optimizer, _ = owner
    parts = optimizer.partitions
    if what == "param":
        return parts.master_of(param)
    if what == "grad":
        return parts.grad_of(param)
    return _state_of(optimizer, param, key)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of `param`'s fp32 master (a view: writing it changes the master)."""
    return _local(param, "param")


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of `param`'s reduced fp32 gradient (between backward and step)."""
    return _local(param, "grad")


def safe_get_local_optimizer_state(
    param: torch.Tensor, optim_state_key: str
) -> torch.Tensor | None:
    """This rank's piece of an optimizer state of `param`, e.g. ``"exp_avg"``."""
    return _local(param, "state", optim_state_key)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    _set(safe_get_local_fp32_param(param), value, param)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    _set(safe_get_local_grad(param), value, param)


def safe_set_local_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    _set(safe_get_local_optimizer_state(param, optim_state_key), value, param)


def _set(target: torch.Tensor | None, value: torch.Tensor, param: torch.Tensor) -> None:
    if target is None:
        raise ValueError("safe_set_*: the parameter is not trained by a zengine optimizer")
    target.copy_(value.reshape(target.shape))


def _full(param: torch.Tensor, what: str, key: str = "") -> torch.Tensor | None:
    """Every rank's pieces of `param`, put together in its shape (collective)."""
    owner = _owner(param)
    if owner is None:
        return None
    optimizer, frag = owner
    local = _local(param, what, key)
    assert local is not None
    shape = param.ds_shape if hasattr(param, "ds_shape") else param.shape
    numel = int(torch.Size(shape).numel())
    if optimizer.stage == 0:
        return local.clone().view(shape)
    world = zcomm.get_world_size(optimizer.group)
    # every rank sends (offset in the parameter, numel, values padded to the largest piece)
    header = torch.tensor([frag.param_offset, frag.numel], dtype=torch.int64)
    headers = torch.empty(2 * world, dtype=torch.int64)
    zcomm.all_gather_into_tensor(headers, header, group=optimizer.group)
    spans = headers.view(world, 2).tolist()
    width = max(n for _, n in spans)
    padded = torch.zeros(width, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    pieces = torch.empty(world * width, dtype=local.dtype, device=local.device)
    zcomm.all_gather_into_tensor(pieces, padded, group=optimizer.group)
    full = torch.zeros(numel, dtype=local.dtype, device=local.device)
    for r, (offset, n) in enumerate(spans):
        n = max(0, min(n, numel - offset))
        full[offset : offset + n] = pieces[r * width : r * width + n]
    return full.view(shape)


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """`param`'s whole fp32 master (every rank must call)."""
    return _full(param, "param")


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """`param`'s whole reduced fp32 gradient (every rank must call)."""
    return _full(param, "grad")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """An optimizer state of `param`, whole (every rank must call)."""
    return _full(param, "state", optim_state_key)


def _set_full(param: torch.Tensor, value: torch.Tensor, what: str, key: str = "") -> None:
    owner = _owner(param)
    local = _local(param, what, key)
    if owner is None or local is None:
        raise ValueError("safe_set_full_*: the parameter is not trained by a zengine optimizer")
    _, frag = owner
    flat = value.reshape(-1)
    n = max(0, min(frag.numel, flat.numel() - frag.param_offset))
    local[:n].copy_(flat[frag.param_offset : frag.param_offset + n])


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set `param`'s fp32 master from the whole value (each rank keeps its piece)."""
    _set_full(param, value, "param")


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    _set_full(param, value, "grad")


def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    _set_full(param, value, "state", optim_state_key)


_T = TypeVar("_T")


class RepeatingLoader(Generic[_T]):
    """An iterator over `loader` that starts it again whenever it ends (DeepSpeed's
    ``deepspeed.utils.RepeatingLoader``: a pipeline's ``train_batch`` reads on without
    counting epochs)."""

    def __init__(self, loader: Iterable[_T]) -> None:
        self.loader = loader
        self.data_iter: Iterator[_T] = iter(loader)

    def __iter__(self) -> RepeatingLoader[_T]:
        return self

    def __next__(self) -> _T:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader ends the iteration here too
