"""The model made ready for the engine: on the device, in the compute dtype and equal on every
rank (stages 0-2), or partitioned and hooked (stage 3) with its shards where ``offload_param``
puts them; stage 3's layout over the partitioned units; the masters where ``offload_optimizer``
puts them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TypedDict, cast

import torch
import torch.distributed as dist
from torch import nn

import zcomm
import zoffload
import zpartition
from zengine._assembly._leaf_config import mark_configured_leaves
from zengine._config import EngineConfig
from zengine._offload import (
    NvmeShardStore,
    NvmeStateSwapper,
    agree_on_folders,
    agree_on_outcome,
    nvme_offloader,
)
from zengine._optim import ShardedLayout, ZeroOptimizer

__all__ = [
    "MasterPlacement",
    "check_nvme_paths",
    "offload_masters",
    "partition_model",
    "prepare_dense",
    "shards_to_nvme",
    "stage3_layout",
    "swap_to_nvme",
]


def zpartition_params(model: nn.Module) -> list[zpartition.ZeroParameter]:
    """The model's parameters, typed with the attributes partitioned ones carry."""
    return cast("list[zpartition.ZeroParameter]", list(model.parameters()))


def check_nvme_paths(model: nn.Module, cfg: EngineConfig) -> None:
    """Before the model is touched: the ``nvme_path`` of ``offload_param`` and
    ``offload_optimizer`` there (made if missing), a writable directory, with room for what is
    known now (the shards, the fp32 masters; the optimizer state comes at the first step and
    is checked as it is written), agreed across every rank ([Note: NVMe faults agreed])."""
    zero = cfg.zero_optimization
    numel = sum(p.ds_numel if zpartition.is_zero_param(p) else p.numel()
                for p in zpartition_params(model))  # fmt: skip
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank = -(-numel // world)
    needs: dict[str | os.PathLike[str], int] = {}  # one folder for both: once, for the sum
    if zero.offload_param.device == "nvme" and zero.offload_param.nvme_path is not None:
        path = zero.offload_param.nvme_path
        needs[path] = needs.get(path, 0) + per_rank * cfg.dtype.itemsize
    if zero.offload_optimizer.device == "nvme" and zero.offload_optimizer.nvme_path is not None:
        path = zero.offload_optimizer.nvme_path
        needs[path] = needs.get(path, 0) + per_rank * 4
    if needs:
        agree_on_folders(list(needs.items()), None, "initialize")


def prepare_dense(
    model: nn.Module, cfg: EngineConfig, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Stages 0-2: the model on the device, in the compute dtype, equal on every rank."""
    check_nvme_paths(model, cfg)
    model.to(device)
    if cfg.dtype != torch.float32:
        model.to(cfg.dtype)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*model.parameters(), *model.buffers()]:
        zcomm.broadcast(tensor.data, src, group=group)


class MasterPlacement(TypedDict, total=False):
    """The layouts' keyword arguments that place the masters (none: on the device)."""

    master_device: torch.device
    own_masters: bool


def offload_masters(cfg: EngineConfig) -> MasterPlacement:
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


def swap_to_nvme(zero: ZeroOptimizer, cfg: EngineConfig) -> None:
    """``offload_optimizer.device: nvme``: the masters and the state go to files under
    ``nvme_path`` (one folder per rank) between steps."""
    settings = cfg.zero_optimization.offload_optimizer
    if settings.device != "nvme":
        return
    assert settings.nvme_path is not None  # the config requires it with nvme
    what = "offload_optimizer to NVMe"
    tiles = zero.tile_tensors()
    masters = sum(t.untyped_storage().nbytes() for tile in tiles for t in tile)
    agree_on_folders([(settings.nvme_path, masters)], None, what)
    # this process's, marked ([Note: swap folders] in zoffload): a killed job's go at the next
    folder = zoffload.claim_folder(settings.nvme_path, f"zengine-optimizer-rank{zcomm.get_rank()}")
    zero.swapper = NvmeStateSwapper(
        zero.optimizer,
        folder,
        pin_memory=settings.pin_memory,
        offloader=nvme_offloader(cfg.aio),
        tiles=tiles,
    )
    zero.swap_out_states()
    agree_on_outcome(zero.swapper.take_failure(), None, what)  # the first writes, agreed


def partition_model(
    model: nn.Module,
    cfg: EngineConfig,
    group: dist.ProcessGroup | None,
    device: torch.device,
    reduce_scale: tuple[float, float] | None = None,
    replicate_group: dist.ProcessGroup | None = None,
) -> zpartition.Partitioned:
    """Stage 3: partition what is not yet (cast to fp16 or bf16 when one is enabled; else
    left in its own dtype, as at stages 0-2), then hook the model; `reduce_scale`: the
    factors of DeepSpeed's reduction options (None: the mean); `replicate_group`: hybrid
    sharding's, `group` then being the shard group."""
    check_nvme_paths(model, cfg)  # before anything is partitioned
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
        replicate_group=replicate_group,
    )
    return handle


def stage3_layout(
    handle: zpartition.Partitioned,
    groups: list[list[nn.Parameter]],
    cfg: EngineConfig,
    group: dist.ProcessGroup | None,
    device: torch.device,
    offload: MasterPlacement,
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
    shards_to_nvme(handle, layout, cfg)
    handle.set_gradient_sink(layout.sink)
    layout.model = handle
    if handle.replicate_group is not None:
        layout.all_reduce_replicas = handle.all_reduce_replicas
    layout.take_written = handle.take_written  # masters re-read from shards written directly
    return layout


def _offload_params(model: nn.Module, cfg: EngineConfig, device: torch.device) -> torch.device:
    """``offload_param``: the shards on the host (pinned if asked), copied to the device before
    each all-gather (with ``nvme`` they wait in files while released, `shards_to_nvme`);
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


def shards_to_nvme(
    handle: zpartition.Partitioned, layout: ShardedLayout | None, cfg: EngineConfig
) -> None:
    zero = cfg.zero_optimization
    settings = zero.offload_param
    if settings.device != "nvme":
        return
    assert settings.nvme_path is not None  # the config requires it with nvme
    shards = sum(u.shard.untyped_storage().nbytes() for u in handle.units if not u.persistent)
    agree_on_folders([(settings.nvme_path, shards)], None, "offload_param to NVMe")
    # never more than a tile of the step ahead: a tiled step holds a few tiles at most
    read_ahead = int(min(zero.stage3_prefetch_bucket_size, zero.sub_group_size))
    # built under zengine's zero.Init with this config: its store holds the shards already
    found = [u.store for u in handle.units if isinstance(u.store, NvmeShardStore)]
    store = found[0] if found else None
    if store is None:
        store = NvmeShardStore(
            settings.nvme_path, zcomm.get_rank(), nvme_offloader(cfg.aio, "params"), read_ahead
        )
    store.read_ahead = read_ahead
    handle.set_shard_store(store)
    if layout is not None:
        layout.shard_store = store
        layout.partitioned = handle  # the step brings every shard in, and sends them back after
