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
import os
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch.distributed as dist

import zcomm
import zpartition
from zengine._config import AioConfig, ZeroConfig, read_config, read_section
from zengine._engine import Engine
from zengine._offload import NvmeShardStore, nvme_offloader
from zpartition import (
    GatheredParameters,
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


def _nvme_store(config: object) -> NvmeShardStore | None:
    """The store of a config whose ``zero_optimization.offload_param`` is on NVMe, else None.
    Only such a config is validated here: any other is zpartition's to read, and one that
    Transformers passes before its Trainer has filled the "auto" sizes (``reduce_bucket_size``
    and the like need the model) must not fail for keys this does not use."""
    if not isinstance(config, (Mapping, str, os.PathLike)):
        return None
    raw = read_config(config)
    zero_raw = raw.get("zero_optimization")
    param = zero_raw.get("offload_param") if isinstance(zero_raw, Mapping) else None
    if not isinstance(param, Mapping) or param.get("device") != "nvme":
        return None
    assert isinstance(zero_raw, Mapping)
    # "auto" sizes take their defaults here: the read-ahead is bounded by them
    filled = {k: v for k, v in zero_raw.items() if v != "auto"}
    zero = read_section({"zero_optimization": filled}, "zero_optimization")
    assert isinstance(zero, ZeroConfig)
    settings = zero.offload_param
    if settings.nvme_path is None:
        return None
    aio = read_section(raw, "aio") if "aio" in raw else None
    assert aio is None or isinstance(aio, AioConfig)
    if not dist.is_initialized():
        zcomm.init_distributed()
    return NvmeShardStore(
        settings.nvme_path,
        zcomm.get_rank(),
        nvme_offloader(aio, "params"),
        read_ahead=int(min(zero.stage3_prefetch_bucket_size, zero.sub_group_size)),
    )


class Init(zpartition.Init):
    """zpartition's `Init`; with a config whose ``offload_param`` is on NVMe (and no
    ``shard_store`` given) the shards go to NVMe files as modules are built ([Note: building
    beyond memory]), and `initialize` trains from the same files."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        enabled = kwargs.get("enabled", True)
        if enabled and kwargs.get("shard_store") is None:
            config = kwargs.get("config_dict_or_path") or kwargs.get("config")
            if config is None and len(args) >= 5:  # DeepSpeed's positional order
                config = args[4]
            kwargs["shard_store"] = _nvme_store(config)
        super().__init__(*args, **kwargs)


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
