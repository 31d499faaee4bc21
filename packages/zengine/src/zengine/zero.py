"""``zengine.zero``: DeepSpeed's ``deepspeed.zero`` names, from zpartition, and
``deepspeed.runtime.zero.unwrap_model_for_generation``.

[Note: building beyond memory]
zpartition's `Init` cuts each module's parameters as the module is built, so no rank holds the
model whole; but the shards of the whole model still sit in host memory (2.3 B bf16
parameters: 4.6 GB, more than the resident target of ZeRO-Infinity on a machine whose memory
the model's state exceeds). So zengine's `Init`, given a config whose ``offload_param`` is on
NVMe, hands zpartition a `NvmeShardStore` (zpartition knows stores, not configs or disks):
each module's shard goes to its file as soon as the module is cut, `partition` moves the
shards into its units one at a time (fetched, copied, evicted again), and `initialize` keeps
the same store, so the files written while building are the ones training reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

import zcomm
import zpartition
from zengine._assembly import hybrid_groups
from zengine._config import ConfigError, ConfigSource, EngineConfig, load_config, read_config
from zengine._engine import Engine
from zengine._initialize import DataParallelUnit
from zengine._offload import NvmeShardStore, nvme_offloader
from zpartition import (
    GatheredParameters,
    ShardStore,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
]


_E = TypeVar("_E", bound=Engine)

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class Init(zpartition.Init):
    """DeepSpeed's ``deepspeed.zero.Init``: zpartition's `Init`, set from a DeepSpeed config.

    The config (a dict, or a JSON or HJSON file's path; `config` is an alias) is validated as
    `initialize` validates it, with its ``"auto"`` values taking their defaults (Transformers
    builds the model before its Trainer fills them, and DeepSpeed does the same), so a
    config's problems are named here, before the model is built. From it come: the parameter
    dtype (bf16 or fp16, when enabled; `dtype` wins), hybrid sharding's groups
    (``zero_optimization.mics_shard_size``, when neither group is given), the
    `zpartition.ZeroParamConfig` (its hpZ size checked against the group), and with
    ``offload_param`` on NVMe a store that takes each module's shard to its file as soon as the
    module is cut ([Note: building beyond memory]); `initialize` trains from the same files.
    ``remote_device="nvme"`` (DeepSpeed's spelling) asks for that store: the config's
    ``offload_param`` must then be on NVMe.

    DeepSpeed's positional order; `mem_efficient_linear`, `mpu` (but for its data-parallel
    group) and the quantization switches are accepted and do nothing here (zpartition's
    ``partition`` quantizes the passes' gathers from the engine's config). zstack's own keywords
    (`sync_module_states`, `replicate_group`, `shard_store`) are zpartition's.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        mem_efficient_linear: bool = True,
        remote_device: str | torch.device | None = None,
        pin_memory: bool = False,
        config_dict_or_path: ConfigSource = None,
        config: ConfigSource = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: DataParallelUnit | None = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        *,
        sync_module_states: bool = True,
        replicate_group: dist.ProcessGroup | None = None,
        shard_store: ShardStore | None = None,
    ) -> None:
        given = config_dict_or_path if config_dict_or_path is not None else config
        param_config = None
        nvme = remote_device == "nvme"
        if enabled:
            if not dist.is_initialized():
                zcomm.init_distributed()
            if data_parallel_group is None and mpu is not None:
                data_parallel_group = mpu.get_data_parallel_group()
            cfg = self._read(given, data_parallel_group, replicate_group)
            if data_parallel_group is None and replicate_group is None:
                data_parallel_group, replicate_group = hybrid_groups(cfg, None)
            if dtype is None and (cfg.fp16_enabled or cfg.bf16_enabled):
                dtype = cfg.dtype
            param_config = cfg.zero_param_config()
            if shard_store is None:
                shard_store = _nvme_store(cfg, nvme)
        if nvme:
            remote_device = "cpu"  # the store holds the shards; none stays on the device
        super().__init__(
            module,
            data_parallel_group,
            remote_device,
            pin_memory,
            enabled,
            dtype,
            sync_module_states,
            replicate_group,
            shard_store,
            param_config,
        )

    def _read(
        self,
        config: ConfigSource,
        group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
    ) -> EngineConfig:
        """`config` validated as `initialize` validates a model's without an optimizer, its
        batch sizes against the data-parallel ranks (the shard group's times its replicas)."""
        world = dist.get_world_size(group)
        if replicate_group is not None:
            world *= dist.get_world_size(replicate_group)
        raw = read_config(config)
        if not any(key in raw for key in _BATCH_KEYS):
            # Init builds, it does not train: without batch sizes (which DeepSpeed's Init
            # asks for) one sample per rank; given ones are checked as initialize checks them
            raw["train_micro_batch_size_per_gpu"] = 1
        cfg = load_config(raw, world_size=world, with_optimizer=False)
        self._check(cfg)
        return cfg

    def _check(self, cfg: EngineConfig) -> None:
        """What a subclass requires of the config, before anything is built (none here)."""


def _nvme_store(cfg: EngineConfig, asked: bool) -> NvmeShardStore | None:
    """The store of a config whose ``zero_optimization.offload_param`` is on NVMe, else None
    (`asked`: ``remote_device="nvme"``, which needs such a config)."""
    zero = cfg.zero_optimization
    settings = zero.offload_param
    if settings.device != "nvme":
        if asked:
            raise ConfigError(
                [
                    'zero_optimization.offload_param.device: Init(remote_device="nvme") needs '
                    f"'nvme' (with an nvme_path), got {settings.device!r}"
                ]
            )
        return None
    assert settings.nvme_path is not None  # the section requires it with "nvme"
    return NvmeShardStore(
        settings.nvme_path,
        zcomm.get_rank(),
        nvme_offloader(cfg.aio, "params"),
        read_ahead=int(min(zero.stage3_prefetch_bucket_size, zero.sub_group_size)),
    )


@contextlib.contextmanager
def unwrap_model_for_generation(model: _E) -> Iterator[_E]:
    """Yield the engine `model` ready for generation, as DeepSpeed's: at ZeRO stage 3 every
    parameter is gathered once and the hooks are off inside, so each token's forward runs as
    on a plain model; after the block the parameters are released and the hooks are back.
    Every rank must enter it (it gathers the whole model on each)."""
    if not isinstance(model, Engine):
        raise TypeError(
            "unwrap_model_for_generation(model): expected the engine zengine.initialize "
            f"returned, got {type(model).__name__}"
        )
    if model.partitioned is None:  # stages 0-2: the parameters are whole already
        yield model
        return
    with model.partitioned.unhooked():
        yield model
