"""Where a partitioned parameter's full data is, as DeepSpeed names it."""

from __future__ import annotations

import enum

__all__ = ["ZeroParamStatus"]


class ZeroParamStatus(enum.Enum):
    """`AVAILABLE`: ``param.data`` holds the full parameter; `NOT_AVAILABLE`: only this rank's
    shard exists (``param.data`` is empty); `INFLIGHT`: an all-gather is on its way."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3
