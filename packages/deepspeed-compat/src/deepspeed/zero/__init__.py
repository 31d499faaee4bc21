"""``deepspeed.zero``: `Init`, `GatheredParameters` and external parameters (zpartition's, through
zengine.zero), and `MiCS_Init`."""

from typing import Any

from torch import distributed as dist
from torch import nn

from zengine import EngineConfig
from zengine.zero import *  # noqa: F403 - zengine.zero is DeepSpeed's deepspeed.zero
from zengine.zero import Init
from zengine.zero import __all__ as _zero_names

__all__ = [*_zero_names, "MiCS_Init"]


class MiCS_Init(Init):
    """DeepSpeed's: `Init` sharding within the groups of the config's
    ``zero_optimization.mics_shard_size`` (which `Init` reads from any config it is given;
    here the config must set it, as DeepSpeed asserts). Past the first two, its arguments are
    `Init`'s, by keyword (DeepSpeed's third is a sequence-parallel group, which zstack has not)."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(module, data_parallel_group, **kwargs)

    def _check(self, cfg: EngineConfig) -> None:
        if cfg.zero_optimization.mics_shard_size == -1:
            raise ValueError(
                "deepspeed.zero.MiCS_Init: the config's zero_optimization.mics_shard_size must "
                'be set (a number of ranks; zstack also takes "node")'
            )
