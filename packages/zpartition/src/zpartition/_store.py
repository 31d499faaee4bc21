"""Where shards wait while nobody gathers them: parameter offload beyond host memory.

By default a unit's shard stays in memory. A `ShardStore` (``Partitioned.set_shard_store``)
lets it go when the unit is released and brings it back before the unit is gathered again;
zpartition calls it, an engine provides it (zengine keeps shards in files for
``offload_param: {device: nvme}``). The shard tensor stays the same object, so every view of
it (``ds_tensor``) is valid again once it is back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["ShardStore"]


class ShardStore(Protocol):
    def fetch(self, shards: Sequence[torch.Tensor]) -> None:
        """Make `shards` resident again (a no-op for those that are)."""

    def evict(self, shard: torch.Tensor) -> None:
        """Keep `shard`'s bytes elsewhere and free its memory (its storage may go to 0 bytes);
        bytes written since it was fetched must be kept too."""
