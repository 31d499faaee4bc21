"""`initialize`: DeepSpeed's entry point, with its signature and return value.

It reads the config, prepares the model (on the device, in the compute dtype, partitioned at
stage 3), builds the ZeRO optimizer over the flat partitions, the LR scheduler and the loss
scaler, and returns ``(engine, optimizer, dataloader, lr_scheduler)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import zcomm
import zpartition
from zengine._assembly._leaf_config import mark_configured_leaves
from zengine._assembly._refusals import (
    check_allgather_bucket_size,
    check_offloaded_optimizer,
    checked_optimizer,
)
from zengine._config import EngineConfig, load_config
from zengine._engine import Engine
from zengine._errors import MissingArgumentError
from zengine._offload import NvmeShardStore, NvmeStateSwapper, nvme_offloader
from zengine._optim import (
    DynamicLossScaler,
    FlatLayout,
    LossScaler,
    ShardedLayout,
    StaticLossScaler,
    ZeroOptimizer,
    autocast_loss_scaler,
    build_scheduler,
    mark_comm_dtypes,
)
from zengine._unused_params import is_optimized
from zengine.ops.lion import FusedLion

__all__ = ["initialize"]

_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "lion": FusedLion,
}
_DEEPSPEED_ONLY = ("torch_adam", "adam_w_mode", "fused")  # optimizer params torch does not take


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset[Any] | None = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    config_params: Any = None,
) -> tuple[Engine, Any, DataLoader[Any] | None, Any]:
    """Build the engine: ``engine, optimizer, dataloader, lr_scheduler = initialize(...)``.

    `config` (or its alias `config_params`, or ``args.deepspeed_config``) is a dict or a JSON
    path with DeepSpeed's keys. `optimizer` may be None (the config's), a torch optimizer, or a
    callable taking parameter groups; `lr_scheduler` None (the config's), a scheduler, or a
    callable taking the optimizer.
    """
    if model is None:
        hint = ""
        if isinstance(args, nn.Module):  # initialize(model, ...): the first argument is args
            hint = (
                f": a module ({type(args).__name__}) came as the first positional argument, "
                "which is args; pass it as model=..."
            )
        raise MissingArgumentError(f"initialize: model is required{hint}")
    if config is None:
        config = config_params if config_params is not None else _config_from_args(args)
    zcomm.init_distributed(dist_init_required=dist_init_required)
    from zengine.pipe import PipelineModule, initialize_pipeline  # the sub-package builds on this

    if isinstance(model, PipelineModule):
        return initialize_pipeline(
            model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            collate_fn=collate_fn,
            config=config,
        )
    group = mpu.get_data_parallel_group() if mpu is not None else None
    cfg = load_config(config, world_size=dist.get_world_size(group))
    device = torch.device(zcomm.get_accelerator().current_device_name())
    groups, options = _param_groups(model, optimizer, model_parameters)
    make_optimizer = _optimizer_factory(optimizer, cfg)  # its errors come before any change
    if make_optimizer is None:
        engine = _without_optimizer(model, lr_scheduler, cfg, group, device)
        return engine, None, training_loader(engine, training_data, collate_fn), None
    check_allgather_bucket_size(cfg)
    # DeepSpeed's reduction options, as factors around a sum ([Note: gradient reduction])
    reduce_scale = cfg.gradient_reduction.factors(dist.get_world_size(group))
    mark_comm_dtypes(model, cfg, device)  # before the gradient buckets are cut
    loss_scaler = _loss_scaler(cfg, device)
    offload = _offload_masters(cfg)
    layout: FlatLayout | ShardedLayout
    if cfg.zero_stage == 3:
        handle = _partition(model, cfg, group, device, reduce_scale)
        layout = _stage3_layout(handle, groups, cfg, group, device, offload)
    else:
        handle = None
        _prepare_dense(model, cfg, group, device)
        layout = FlatLayout(
            groups,
            stage=cfg.zero_stage,
            group=group,
            device=device,
            bucket_size=int(cfg.zero_optimization.reduce_bucket_size),
            overlap=cfg.zero_optimization.overlap_comm,
            reduce_dtype=cfg.communication_dtype,
            accumulate_dtype=cfg.accumulation_dtype,
            reduce_scale=reduce_scale,
            **offload,
        )
    zero = ZeroOptimizer(
        make_optimizer,
        options,
        layout,
        stage=cfg.zero_stage,
        group=group,
        loss_scaler=loss_scaler,
        clip=float(cfg.gradient_clipping),
        nonfinite=cfg.nonfinite_gradients,
    )
    _swap_to_nvme(zero, cfg)
    for g in groups:
        for p in g:
            p.__dict__["_zengine_optimizer"] = zero  # how the safe_get_* functions find it
    scheduler = _scheduler(lr_scheduler, zero, cfg)
    engine = Engine(model, zero, scheduler, config=cfg, device=device, partitioned=handle)
    return engine, zero, training_loader(engine, training_data, collate_fn), scheduler


def _without_optimizer(
    model: nn.Module,
    lr_scheduler: Any,
    cfg: EngineConfig,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> Engine:
    """No optimizer anywhere: as DeepSpeed, an engine for forward passes (ZeRO-3 inference,
    evaluation): the model prepared and partitioned as for training, but no master weights,
    gradient partitions or optimizer state; ``backward()`` and ``step()`` say what is missing."""
    if lr_scheduler is not None or cfg.scheduler is not None:
        given = "initialize(lr_scheduler=...)" if lr_scheduler is not None else "'scheduler'"
        raise ValueError(
            f"initialize: {given} needs an optimizer, and there is none: pass optimizer=... "
            "or add an 'optimizer' section to the config"
        )
    if cfg.zero_optimization.offload_optimizer.device != "none":
        raise ValueError(
            "zero_optimization.offload_optimizer: there is no optimizer to offload (initialize "
            "was given none and the config has no 'optimizer' section)"
        )
    handle = None
    mark_comm_dtypes(model, cfg, device)  # their config errors come as training's would
    if cfg.zero_stage == 3:
        handle = _partition(model, cfg, group, device)
        _shards_to_nvme(handle, None, cfg)
    else:
        _prepare_dense(model, cfg, group, device)
    return Engine(model, None, None, config=cfg, device=device, partitioned=handle, group=group)


def zpartition_params(model: nn.Module) -> list[zpartition.ZeroParameter]:
    """The model's parameters, typed with the attributes partitioned ones carry."""
    return cast("list[zpartition.ZeroParameter]", list(model.parameters()))


def _config_from_args(args: Any) -> Any:
    path = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if path is None:
        raise ValueError(
            "initialize: no config: pass config={...} (a dict or a JSON path), or "
            "args with deepspeed_config"
        )
    return path


def _param_groups(
    model: nn.Module, optimizer: Any, model_parameters: Iterable[Any] | None
) -> tuple[list[list[nn.Parameter]], list[dict[str, Any]]]:
    """The trainable parameters by optimizer group, and each group's options. Parameters
    without elements are left out, as DeepSpeed leaves them: nothing to step."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raw: list[Any] = list(optimizer.param_groups)
    else:
        raw = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if raw and not isinstance(raw[0], dict):
        raw = [{"params": raw}]
    groups: list[list[nn.Parameter]] = []
    options: list[dict[str, Any]] = []
    seen: set[int] = set()
    for entry in raw:
        params = [p for p in entry["params"] if is_optimized(p) and id(p) not in seen]
        seen.update(id(p) for p in params)
        groups.append(params)
        options.append({k: v for k, v in entry.items() if k != "params"})
    return groups, options


def _prepare_dense(
    model: nn.Module, cfg: EngineConfig, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Stages 0-2: the model on the device, in the compute dtype, equal on every rank."""
    model.to(device)
    if cfg.dtype != torch.float32:
        model.to(cfg.dtype)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*model.parameters(), *model.buffers()]:
        zcomm.broadcast(tensor.data, src, group=group)


def _offload_masters(cfg: EngineConfig) -> dict[str, Any]:
    """Where the layouts keep the masters: on the host with ``offload_optimizer``, and a copy
    of their own with NVMe (which empties them between steps)."""
    device = cfg.zero_optimization.offload_optimizer.device
    if device == "none":
        return {}
    if cfg.zero_stage == 0:
        raise ValueError(
            "zero_optimization.offload_optimizer: needs ZeRO stage 1, 2 or 3 (the stage is 0)"
        )
    return {"master_device": torch.device("cpu"), "own_masters": device == "nvme"}


def _swap_to_nvme(zero: ZeroOptimizer, cfg: EngineConfig) -> None:
    """``offload_optimizer.device: nvme``: the masters and the state go to files under
    ``nvme_path`` (one folder per rank) between steps."""
    settings = cfg.zero_optimization.offload_optimizer
    if settings.device != "nvme":
        return
    assert settings.nvme_path is not None  # the config requires it with nvme
    folder = Path(settings.nvme_path) / f"zengine-optimizer-rank{zcomm.get_rank()}"
    zero.swapper = NvmeStateSwapper(
        zero.optimizer,
        folder,
        pin_memory=settings.pin_memory,
        offloader=nvme_offloader(cfg.aio),
        tiles=zero.tile_tensors(),
    )
    zero.swap_out_states()


def _partition(
    model: nn.Module,
    cfg: EngineConfig,
    group: dist.ProcessGroup | None,
    device: torch.device,
    reduce_scale: tuple[float, float] | None = None,
) -> zpartition.Partitioned:
    """Stage 3: partition what is not yet (cast to fp16 or bf16 when one is enabled; else
    left in its own dtype, as at stages 0-2), then hook the model; `reduce_scale`: the
    factors of DeepSpeed's reduction options (None: the mean)."""
    mark_configured_leaves(model, cfg.zero_optimization.leaf_module)  # before the units form
    cast = cfg.dtype if cfg.dtype != torch.float32 else None
    for p in zpartition_params(model):
        if zpartition.is_zero_param(p):
            if cast is not None and p.is_floating_point() and p.ds_tensor.dtype != cast:
                p.ds_tensor = p.ds_tensor.to(cast)
                p.data = torch.empty(0, dtype=cast, device=p.device)
        else:
            dtype = cast if cast is not None and p.is_floating_point() else p.dtype
            p.data = p.data.to(device, dtype)
    for b in model.buffers():
        b.data = b.data.to(device)
    shard_device = _offload_params(model, cfg, device)
    # DeepSpeed's contiguous gradient buffer: kept where the caching allocator keeps the
    # memory anyway; on CPU, where a freed bucket goes back to the system ([Note: returning
    # memory on CPU]), only when the config names contiguous_gradients itself
    zero = cfg.zero_optimization
    asked = "contiguous_gradients" in zero.model_fields_set
    keep = zero.contiguous_gradients and (device.type == "cuda" or asked)
    knobs = dataclasses.replace(
        cfg.zero_param_config(), persistent_grad_buckets=keep, reduce_scale=reduce_scale
    )
    handle = zpartition.partition(
        model,
        config=knobs,
        group=group,
        shard_device=shard_device,
        pin_memory=zero.offload_param.pin_memory,
    )
    return handle


def _stage3_layout(
    handle: zpartition.Partitioned,
    groups: list[list[nn.Parameter]],
    cfg: EngineConfig,
    group: dist.ProcessGroup | None,
    device: torch.device,
    offload: dict[str, Any],
) -> ShardedLayout:
    """Stage 3's masters and gradient partitions over the partitioned model's units."""
    zero = cfg.zero_optimization
    layout = ShardedLayout(
        groups,
        group=group,
        device=device,
        grad_dtype=cfg.accumulation_dtype,
        units=handle.units,
        sub_group_size=int(zero.sub_group_size),
        **offload,
    )
    _shards_to_nvme(handle, layout, cfg)
    handle.set_gradient_sink(layout.sink)
    layout.take_written = handle.take_written  # masters re-read from shards written directly
    return layout


def _offload_params(model: nn.Module, cfg: EngineConfig, device: torch.device) -> torch.device:
    """``offload_param``: the shards on the host (pinned if asked), copied to the device before
    each all-gather (with ``nvme`` they wait in files while released, `_shards_to_nvme`);
    returns where the shards live."""
    settings = cfg.zero_optimization.offload_param
    if settings.device == "none":
        return device
    host = torch.device("cpu")
    pin = settings.pin_memory and torch.cuda.is_available()
    for p in zpartition_params(model):
        if zpartition.is_zero_param(p) and p.ds_tensor.device != host:
            shard = p.ds_tensor.to(host)
            p.ds_tensor = shard.pin_memory() if pin else shard
    return host


def _shards_to_nvme(
    handle: zpartition.Partitioned, layout: ShardedLayout | None, cfg: EngineConfig
) -> None:
    zero = cfg.zero_optimization
    settings = zero.offload_param
    if settings.device != "nvme":
        return
    assert settings.nvme_path is not None  # the config requires it with nvme
    store = NvmeShardStore(
        settings.nvme_path,
        zcomm.get_rank(),
        nvme_offloader(cfg.aio, "params"),
        # never more than a tile of the step ahead: a tiled step holds a few tiles at most
        read_ahead=int(min(zero.stage3_prefetch_bucket_size, zero.sub_group_size)),
    )
    handle.set_shard_store(store)
    if layout is not None:
        layout.shard_store = store
        layout.partitioned = handle  # the step brings every shard in, and sends them back after


def _optimizer_factory(
    optimizer: Any, cfg: EngineConfig
) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None:
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


def _fusable(groups: list[dict[str, Any]]) -> bool:
    """Whether torch's fused Adam takes these parameters (on CPU or CUDA, floating point)."""
    tensors = [p for g in groups for p in g["params"]]
    return all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in tensors)


def _repoint(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> Any:
    """The user's optimizer, stepping the masters: its groups keep their options."""
    for mine, new in zip(optimizer.param_groups, groups, strict=True):
        mine["params"] = new["params"]
    optimizer.state.clear()
    return optimizer


def _loss_scaler(cfg: EngineConfig, device: torch.device) -> LossScaler | None:
    if not cfg.fp16_enabled:
        return autocast_loss_scaler(cfg, device)  # fp16 autocast has one too
    fp16 = cfg.fp16
    if fp16.loss_scale:
        return StaticLossScaler(float(fp16.loss_scale))
    # DeepSpeed's stage 0 scales with its FP16_Optimizer, whose raises come one clean step
    # later and which keeps going at the minimum scale; its ZeRO stages stop the run there.
    stage_0 = cfg.zero_stage == 0
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power,
        scale_window=fp16.loss_scale_window,
        min_scale=float(fp16.min_loss_scale),
        delayed_shift=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        raise_error_at_min_scale=not stage_0,
        window_after_overflow=stage_0,
    )


def _scheduler(lr_scheduler: Any, zero: ZeroOptimizer, cfg: EngineConfig) -> Any:
    if lr_scheduler is not None:
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler) or hasattr(
            lr_scheduler, "step"
        ):
            return lr_scheduler
        return lr_scheduler(zero.optimizer)
    if cfg.scheduler is None:
        return None
    return build_scheduler(cfg.scheduler.type, zero.optimizer, dict(cfg.scheduler.params))


def training_loader(
    engine: Engine, data: Dataset[Any] | None, collate_fn: Callable[..., Any] | None
) -> DataLoader[Any] | None:
    """The loader `initialize` returns for `training_data`, made by ``engine.deepspeed_io`` (as
    DeepSpeed's: a patched ``deepspeed_io`` reaches it); kept as ``engine.training_dataloader``."""
    loader = engine.deepspeed_io(data, collate_fn=collate_fn) if data is not None else None
    engine.training_dataloader = loader
    return loader
