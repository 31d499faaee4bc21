"""``deepspeed.zero``: `Init`, `GatheredParameters` and external parameters (zpartition's, through
zengine.zero), and `MiCS_Init`."""

import json
from pathlib import Path
from typing import Any

from zengine.zero import *  # noqa: F403 - zengine.zero is DeepSpeed's deepspeed.zero
from zengine.zero import Init
from zengine.zero import __all__ as _zero_names

__all__ = [*_zero_names, "MiCS_Init"]


class MiCS_Init(Init):
    """DeepSpeed's: `Init` sharding within the groups of the config's
    ``zero_optimization.mics_shard_size`` (which `Init` reads from any config it is given;
    here the config must set it, as DeepSpeed asserts)."""

    def __init__(
        self,
        module: Any = None,
        data_parallel_group: Any = None,
        *,
        config_dict_or_path: dict[str, Any] | str | Path | None = None,
        config: dict[str, Any] | str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        given = config_dict_or_path if config_dict_or_path is not None else config
        loaded = json.loads(Path(given).read_text()) if isinstance(given, str | Path) else given
        loaded = loaded or {}
        size = (loaded.get("zero_optimization") or {}).get("mics_shard_size", -1)
        if size in (-1, None):
            raise ValueError(
                "deepspeed.zero.MiCS_Init: the config's zero_optimization.mics_shard_size must "
                'be set (a number of ranks; zstack also takes "node")'
            )
        super().__init__(module, data_parallel_group, config_dict_or_path=given, **kwargs)
