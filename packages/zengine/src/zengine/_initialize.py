"""`initialize`: DeepSpeed's entry point, with its signature and return value.

It reads the config, prepares the model (on the device, in the compute dtype, partitioned at
stage 3), builds the ZeRO optimizer over the flat partitions, the LR scheduler and the loss
scaler, and returns ``(engine, optimizer, dataloader, lr_scheduler)``; a `PipelineModule` goes
to the pipeline's `initialize_pipeline`. The parts come from the _assembly subpackage, which
both share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import zcomm
from zengine._agreement import agree, describe_setup
from zengine._assembly import (
    ClientOptimizer,
    ClientScheduler,
    ModelParameters,
    check_allgather_bucket_size,
    hybrid_groups,
    make_loss_scaler,
    make_scheduler,
    offload_masters,
    optimizer_factory,
    param_groups,
    partition_model,
    prepare_dense,
    shards_to_nvme,
    stage3_layout,
    swap_to_nvme,
)
from zengine._config import ConfigSource, EngineConfig, load_config, read_config
from zengine._engine import Engine
from zengine._errors import MissingArgumentError
from zengine._optim import FlatLayout, Scheduler, ShardedLayout, ZeroOptimizer, mark_comm_dtypes
from zengine.pipe import PipelineModule, initialize_pipeline

__all__ = ["DataParallelUnit", "initialize"]


class DataParallelUnit(Protocol):
    """``initialize(mpu=...)``: DeepSpeed's model-parallel unit (Megatron's ``mpu``), of which
    initialize reads the data-parallel group; one without ``get_model_parallel_group`` runs
    the engine on that group's ranks only."""

    def get_data_parallel_group(self) -> dist.ProcessGroup | None: ...


def initialize(
    args: object = None,  # read for deepspeed_config (an argparse Namespace, or anything)
    model: nn.Module | None = None,
    optimizer: ClientOptimizer | None = None,
    model_parameters: ModelParameters | None = None,
    training_data: Dataset[Any] | None = None,
    lr_scheduler: ClientScheduler | None = None,
    mpu: DataParallelUnit | None = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: ConfigSource = None,
    config_params: ConfigSource = None,
) -> tuple[Engine, ZeroOptimizer | None, DataLoader[Any] | None, Scheduler | None]:
    """Build the engine: ``engine, optimizer, dataloader, lr_scheduler = initialize(...)``.

    `config` (or its alias `config_params`, or ``args.deepspeed_config``) is a dict or a JSON
    path with DeepSpeed's keys. `optimizer` may be None (the config's), a torch optimizer, or a
    callable taking parameter groups; `lr_scheduler` None (the config's), a scheduler, or a
    callable taking the optimizer.

    Raises:
        ConfigError: the config is invalid (every problem, each naming its key).
        RankMismatchError: on every rank, when the ranks' effective configs or parameter
            layouts differ, or another rank could not read its config ([Note: agreement at
            initialize]).
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
    pipeline = isinstance(model, PipelineModule)
    group: dist.ProcessGroup | None
    engine_group: dist.ProcessGroup | None = None  # the ranks that call initialize with us
    if isinstance(model, PipelineModule):
        group = model.mpu().get_data_parallel_group()  # the replicas of this rank's stage
    else:
        group = mpu.get_data_parallel_group() if mpu is not None else None
        if mpu is not None and not hasattr(mpu, "get_model_parallel_group"):
            engine_group = group  # an engine on some ranks only: the others never come
    device = torch.device(zcomm.get_accelerator().current_device_name())
    try:  # what each rank reads on its own, before any collective
        raw = read_config(config)
        # a model without an optimizer (TRL's reference model, an inference engine) may come
        # with a config the training run has yet to fill: its "auto" values take the defaults
        # (a pipeline trains: it reads its config as a training one)
        with_optimizer = pipeline or optimizer is not None or raw.get("optimizer") is not None
        world_size = dist.get_world_size(group)
        cfg = load_config(raw, world_size=world_size, with_optimizer=with_optimizer)
        groups, options = param_groups(model, optimizer, model_parameters)
        make_optimizer = optimizer_factory(optimizer, cfg)  # its errors come before any change
        setup = describe_setup(cfg, model, groups, options, optimizer)
    except Exception as error:  # the other ranks hear of it rather than wait for this one
        agree(error, group=group, device=device, engine_group=engine_group)
        raise  # agree raised it already; this line is for the type checker
    # the same config and parameters on every rank (a pipeline's: within each stage's
    # replicas), before the first collective that depends on them ([Note: agreement at
    # initialize])
    agree(setup, group=group, device=device, engine_group=engine_group)
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
    if make_optimizer is None:
        engine = _without_optimizer(model, lr_scheduler, cfg, group, device)
        return engine, None, training_loader(engine, training_data, collate_fn), None
    check_allgather_bucket_size(cfg)
    # DeepSpeed's reduction options, as factors around a sum ([Note: gradient reduction])
    reduce_scale = cfg.gradient_reduction.factors(dist.get_world_size(group))
    mark_comm_dtypes(model, cfg, device)  # before the gradient buckets are cut
    loss_scaler = make_loss_scaler(cfg, device)
    offload = offload_masters(cfg)
    layout: FlatLayout | ShardedLayout
    hybrid = hybrid_groups(cfg, group)  # the data-parallel group, unless mics_shard_size
    if cfg.zero_stage == 3:
        handle = partition_model(model, cfg, hybrid.shard, device, reduce_scale, hybrid.replicate)
        layout = stage3_layout(handle, groups, cfg, hybrid.shard, device, offload)
    else:
        handle = None
        prepare_dense(model, cfg, group, device)
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
        shard_group=hybrid.shard,
    )
    swap_to_nvme(zero, cfg)
    for g in groups:
        for p in g:
            p.__dict__["_zengine_optimizer"] = zero  # how the safe_get_* functions find it
    scheduler = make_scheduler(lr_scheduler, zero, cfg)
    engine = Engine(model, zero, scheduler, config=cfg, device=device, partitioned=handle)
    return engine, zero, training_loader(engine, training_data, collate_fn), scheduler


def _without_optimizer(
    model: nn.Module,
    lr_scheduler: ClientScheduler | None,
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
        handle = partition_model(model, cfg, group, device)
        shards_to_nvme(handle, None, cfg)
    else:
        prepare_dense(model, cfg, group, device)
    return Engine(model, None, None, config=cfg, device=device, partitioned=handle, group=group)


def _config_from_args(args: object) -> ConfigSource:
    path: ConfigSource = getattr(args, "deepspeed_config", None) or getattr(
        args, "deepscale_config", None
    )
    if path is None:
        raise ValueError(
            "initialize: no config: pass config={...} (a dict or a JSON path), or "
            "args with deepspeed_config"
        )
    return path


def training_loader(
    engine: Engine, data: Dataset[Any] | None, collate_fn: Callable[..., Any] | None
) -> DataLoader[Any] | None:
    """The loader `initialize` returns for `training_data`, made by ``engine.deepspeed_io`` (as
    DeepSpeed's: a patched ``deepspeed_io`` reaches it); kept as ``engine.training_dataloader``."""
    loader = engine.deepspeed_io(data, collate_fn=collate_fn) if data is not None else None
    engine.training_dataloader = loader
    return loader
