"""The optimizer side of ``initialize``: the trainable parameters by group, the torch optimizer
(the config's, or the caller's: an optimizer or a callable taking the groups), the loss scaler
and the LR scheduler. The ZeRO optimizer is built over them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from zengine._assembly._refusals import check_offloaded_optimizer, checked_optimizer
from zengine._config import EngineConfig
from zengine._optim import (
    DynamicLossScaler,
    LossScalerBase,
    Scheduler,
    StaticLossScaler,
    ZeroOptimizer,
    autocast_loss_scaler,
    build_scheduler,
)
from zengine._unused_params import is_optimized
from zengine.ops.lion import FusedLion

__all__ = [
    "ClientOptimizer",
    "ClientScheduler",
    "ModelParameters",
    "OptimizerFactory",
    "ParamGroup",
    "SchedulerFactory",
    "make_loss_scaler",
    "make_scheduler",
    "optimizer_factory",
    "param_groups",
]

#: A parameter group as torch's optimizers hold one: ``"params"`` and the group's options.
ParamGroup = dict[str, Any]
#: What builds the torch optimizer over the masters' parameter groups.
OptimizerFactory = Callable[[list[ParamGroup]], torch.optim.Optimizer]
#: ``initialize(optimizer=...)``, when not None: an optimizer, or what builds one.
ClientOptimizer = torch.optim.Optimizer | OptimizerFactory
#: What builds the LR scheduler over the torch optimizer.
SchedulerFactory = Callable[[torch.optim.Optimizer], Scheduler]
#: ``initialize(lr_scheduler=...)``, when not None: a scheduler, or what builds one.
ClientScheduler = Scheduler | SchedulerFactory
#: ``initialize(model_parameters=...)``: parameters, or parameter groups (dicts with
#: ``"params"``), as a torch optimizer's constructor takes them.
ModelParameters = Iterable[torch.Tensor] | Iterable[ParamGroup]

_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "lion": FusedLion,
}


_DEEPSPEED_ONLY = ("torch_adam", "adam_w_mode", "fused")  # optimizer params torch does not take


def param_groups(
    model: nn.Module, optimizer: ClientOptimizer | None, model_parameters: ModelParameters | None
) -> tuple[list[list[nn.Parameter]], list[ParamGroup]]:
    """The trainable parameters by optimizer group, and each group's options. Parameters
    without elements are left out, as DeepSpeed leaves them: nothing to step."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raw: list[Any] = list(optimizer.param_groups)
    else:
        raw = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if raw and not isinstance(raw[0], dict):
        raw = [{"params": raw}]
    groups: list[list[nn.Parameter]] = []
    options: list[ParamGroup] = []
    seen: set[int] = set()
    for entry in raw:
        params = [p for p in entry["params"] if is_optimized(p) and id(p) not in seen]
        seen.update(id(p) for p in params)
        groups.append(params)
        options.append({k: v for k, v in entry.items() if k != "params"})
    return groups, options


def optimizer_factory(
    optimizer: ClientOptimizer | None, cfg: EngineConfig
) -> OptimizerFactory | None:
    """What builds the optimizer over the masters' groups; None when there is no optimizer."""
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_elementwise(optimizer)
        check_offloaded_optimizer(optimizer, cfg)
        return lambda groups: _repoint(optimizer, groups)
    if optimizer is not None:
        if not callable(optimizer):
            raise TypeError(
                "initialize(optimizer=...): expected a torch optimizer, a callable taking "
                f"parameter groups, or None; got {type(optimizer).__name__}"
            )
        return lambda groups: checked_optimizer(optimizer(groups), cfg)
    if cfg.optimizer is None:
        return None
    kind = cfg.optimizer.type.lower()
    params = {k: v for k, v in cfg.optimizer.params.items() if k not in _DEEPSPEED_ONLY}
    if kind in ("adam", "adamw"):
        params.setdefault("weight_decay", 0.0)  # DeepSpeed's default, not torch AdamW's 0.01
    if kind == "adam" and cfg.optimizer.params.get("adam_w_mode", True):
        kind = "adamw"  # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is off
    cls = _OPTIMIZERS[kind]
    if kind not in ("adam", "adamw"):
        return lambda groups: cls(groups, **params)
    # DeepSpeed steps its Adam with a fused kernel (FusedAdam, or its CPU Adam when offloading)
    # unless the config sets torch_adam; torch's fused Adam is that kernel, on CPU and CUDA
    # (measured on CPU, 13 M elements: 7 ms a step against 24-56 ms for the per-tensor loop)
    given = cfg.optimizer.params
    # torch takes no fused kernel with foreach or differentiable: those choose the loop
    loop = given.get("torch_adam", False) or given.get("foreach") or given.get("differentiable")
    fused = bool(given.get("fused", not loop))
    adam = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return lambda groups: adam(groups, **params, fused=fused and _fusable(groups))


# optimizers whose update reads a parameter's shape (torch's Muon orthogonalizes matrices):
# they cannot step flat partitions
_SHAPED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    cls for cls in (getattr(torch.optim, "Muon", None),) if cls is not None
)


def _check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, before anything changes, an optimizer that needs the parameters' shapes: the
    engine steps flat partitions of them (one tensor per group)."""
    if isinstance(optimizer, _SHAPED_OPTIMIZERS):
        raise ValueError(
            f"initialize(optimizer=...): {type(optimizer).__name__} updates each parameter as "
            "a matrix, but the engine steps flat partitions of the parameters, one tensor per "
            "group; use an elementwise optimizer (Adam, AdamW, SGD, Adagrad, Lion)"
        )


def _fusable(groups: list[ParamGroup]) -> bool:
    """Whether torch's fused Adam takes these parameters (on CPU or CUDA, floating point)."""
    tensors = [p for g in groups for p in g["params"]]
    return all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in tensors)


def _repoint(optimizer: torch.optim.Optimizer, groups: list[ParamGroup]) -> torch.optim.Optimizer:
    """The user's optimizer, stepping the masters: its groups keep their options."""
    for mine, new in zip(optimizer.param_groups, groups, strict=True):
        mine["params"] = new["params"]
    optimizer.state.clear()
    return optimizer


def make_loss_scaler(cfg: EngineConfig, device: torch.device) -> LossScalerBase | None:
    if not cfg.fp16_enabled:
        return autocast_loss_scaler(cfg, device)  # fp16 autocast has one too
    fp16 = cfg.fp16
    if fp16.loss_scale:
        return StaticLossScaler(float(fp16.loss_scale))
    # DeepSpeed's stage 0 scales with its FP16_Optimizer, which keeps going at the minimum
    # scale; its ZeRO stages stop the run there.
    stage_0 = cfg.zero_stage == 0
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        min_scale=float(fp16.min_loss_scale),
        delayed_shift=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        raise_error_at_min_scale=not stage_0,
    )


def make_scheduler(
    lr_scheduler: ClientScheduler | None, zero: ZeroOptimizer, cfg: EngineConfig
) -> Scheduler | None:
    if lr_scheduler is not None:
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler) or hasattr(
            lr_scheduler, "step"
        ):
            # DeepSpeed's test: what has step() is the scheduler (mypy keeps the factory in
            # the union here, a callable that may have a step attribute)
            return cast(Scheduler, lr_scheduler)
        return lr_scheduler(zero.optimizer)
    if cfg.scheduler is None:
        return None
    return build_scheduler(cfg.scheduler.type, zero.optimizer, dict(cfg.scheduler.params))
