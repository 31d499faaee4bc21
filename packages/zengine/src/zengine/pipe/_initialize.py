"""`initialize_pipeline`: what `zengine.initialize` does when the model is a PipelineModule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import zcomm
from zengine._assembly import (
    ClientOptimizer,
    ClientScheduler,
    ModelParameters,
    make_loss_scaler,
    make_scheduler,
    optimizer_factory,
    param_groups,
    prepare_dense,
)
from zengine._config import ConfigError, ConfigSource, EngineConfig, load_config
from zengine._optim import FlatLayout, Scheduler, mark_comm_dtypes
from zengine.pipe._engine import PipelineEngine
from zengine.pipe._module import PipelineModule
from zengine.pipe._optimizer import PipeZeroOptimizer

__all__ = ["initialize_pipeline"]


def _check(cfg: EngineConfig, model: PipelineModule) -> None:
    """The config against the module: stages, chunks, schedule and ZeRO stage."""
    pipe, problems = cfg.pipeline, []
    if pipe.stages != "auto" and pipe.stages != model.num_stages:
        problems.append(
            f"pipeline.stages: {pipe.stages}, but the PipelineModule has {model.num_stages} stages"
        )
    if pipe.chunks is not None and pipe.chunks != model.chunks:
        problems.append(
            f"pipeline.chunks: {pipe.chunks}, but the PipelineModule has chunks={model.chunks}"
        )
    if pipe.schedule == "interleaved" and model.chunks < 2:
        problems.append(
            "pipeline.schedule: 'interleaved' needs a PipelineModule built with chunks >= 2"
        )
    if pipe.schedule != "interleaved" and model.chunks > 1:
        problems.append(
            f"pipeline.schedule: {pipe.schedule!r} runs one chunk per stage, but the "
            f"PipelineModule has chunks={model.chunks}; use 'interleaved'"
        )
    if pipe.use_reentrant and pipe.schedule == "zero_bubble":
        problems.append(
            "pipeline.use_reentrant: true with schedule 'zero_bubble': a reentrant checkpoint "
            "cannot run a backward split in two (torch's refuses autograd.grad); set it false "
            "or leave it out"
        )
    if cfg.zero_stage > 1:
        problems.append(
            f"zero_optimization.stage: {cfg.zero_stage} with a PipelineModule; pipeline "
            "parallelism supports ZeRO stages 0 and 1 (stages 2 and 3 would reduce gradients "
            "or gather parameters for every micro-batch)"
        )
    if problems:
        raise ConfigError(problems)


def initialize_pipeline(
    model: PipelineModule,
    *,
    optimizer: ClientOptimizer | None,
    model_parameters: ModelParameters | None,
    training_data: Dataset[Any] | None,
    lr_scheduler: ClientScheduler | None,
    collate_fn: Callable[..., Any] | None,
    config: ConfigSource,
) -> tuple[PipelineEngine, PipeZeroOptimizer, DataLoader[Any] | None, Scheduler | None]:
    """Build the pipeline engine: the stage's model on the device, tied weights equal,
    replicas equal, and the ZeRO optimizer over the data-parallel group of the stage."""
    grid = model.mpu()
    dp_group = grid.get_data_parallel_group()
    cfg = load_config(config, world_size=grid.get_data_parallel_world_size())
    _check(cfg, model)
    device = torch.device(zcomm.get_accelerator().current_device_name())
    groups, options = param_groups(model, optimizer, model_parameters)
    make_optimizer = optimizer_factory(optimizer, cfg)
    if make_optimizer is None:
        raise ValueError(
            "initialize: no optimizer for the PipelineModule: pass optimizer=... or add an "
            "'optimizer' section to the config (a pipeline engine trains; eval_batch runs on it)"
        )
    mark_comm_dtypes(model, cfg, device)
    prepare_dense(model, cfg, dp_group, device)
    model.sync_tied_weights()
    # the gradients are reduced at the schedule's ReduceGrads, after the tied weights' own
    layout = FlatLayout(
        groups,
        stage=cfg.zero_stage,
        group=dp_group,
        device=device,
        during_backward=False,
        reduce_dtype=cfg.communication_dtype,
        accumulate_dtype=cfg.accumulation_dtype,
    )
    zero = PipeZeroOptimizer(
        make_optimizer,
        options,
        layout,
        stage=cfg.zero_stage,
        group=dp_group,
        loss_scaler=make_loss_scaler(cfg, device),
        clip=float(cfg.gradient_clipping),
        pipe_group=grid.get_pipe_parallel_group(),
        copies=model.tied_copies(),
    )
    for g in groups:
        for p in g:
            p.__dict__["_zengine_optimizer"] = zero  # how the safe_get_* functions find it
    scheduler = make_scheduler(lr_scheduler, zero, cfg)
    engine = PipelineEngine(model, zero, scheduler, config=cfg, device=device)
    return engine, zero, _training_loader(engine, training_data, collate_fn), scheduler


def _training_loader(
    engine: PipelineEngine, data: Dataset[Any] | None, collate_fn: Callable[..., Any] | None
) -> DataLoader[Any] | None:
    """The loader of `training_data`, made by ``engine.deepspeed_io`` as DeepSpeed's pipeline
    engine makes it: each data-parallel replica reads its share in the dataset's order (no
    shuffle), so a run reads the samples DeepSpeed's would, in the same micro-batches."""
    if data is None:
        return None
    grid = engine.grid
    sampler: DistributedSampler[Any] = DistributedSampler(
        data,
        num_replicas=grid.get_data_parallel_world_size(),
        rank=grid.get_data_parallel_rank(),
        shuffle=False,
    )
    loader = engine.deepspeed_io(data, data_sampler=sampler, collate_fn=collate_fn)
    engine.training_dataloader = loader
    return loader
