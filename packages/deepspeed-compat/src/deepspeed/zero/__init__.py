"""``deepspeed.zero``: `Init`, `GatheredParameters` and external parameters (zpartition's, through
zengine.zero); MiCS refused."""

from deepspeed._refused import refused
from zengine.zero import *  # noqa: F403 - zengine.zero is DeepSpeed's deepspeed.zero
from zengine.zero import __all__ as _zero_names

__all__ = [*_zero_names, "MiCS_Init"]

MiCS_Init = refused(
    "deepspeed.zero.MiCS_Init",
    "hybrid sharding (MiCS)",
    "Use deepspeed.zero.Init, which shards over every rank.",
)
