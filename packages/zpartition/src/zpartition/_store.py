"""Where shards wait while nobody gathers them: parameter offload beyond host memory.

By default a unit's shard stays in memory. A `ShardStore` (``Partitioned.set_shard_store``)
lets it go when the unit is released and brings it back before the unit is gathered again;
zpartition calls it, an engine provides it (zengine keeps shards in files for
``offload_param: {device: nvme}``). The shard tensor stays the same object, so every view of
it (``ds_tensor``) is valid again once it is back.

A store given to `Init` (``Init(shard_store=...)``) takes each module's shard as soon as the
module is cut, so a model larger than host memory is built without ever being whole in it;
`partition` then moves each unit's shard into its own unit (fetched, copied, the new shard
evicted at once) and hands the old one to the store's optional ``discard(shard)`` (forget it:
its file goes), so the model is never whole in memory there either.
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
