"""The offloader NVMe offload reads and writes through: the config's ``aio`` settings, or
zoffload's own defaults where the config has no such section."""

from __future__ import annotations

import functools
import logging
from typing import Literal

import zoffload
from zengine._config import AioConfig

__all__ = ["nvme_offloader"]

log = logging.getLogger("zengine")


@functools.cache  # one per setting and use: engines alike share its threads
def nvme_offloader(
    aio: AioConfig | None, use: Literal["states", "params"] = "states"
) -> zoffload.Offloader:
    """The offloader for ``use``: ``states`` (optimizer state swaps, `offload_states`) or
    ``params`` (`offload_param` shards). Parameter shards get threads of their own: a forward
    waits for them, and must not queue behind the optimizer state read ahead of the step."""
    if aio is None:
        if use == "states":
            return zoffload.default_offloader()
        return zoffload.Offloader(pool=zoffload.default_pool())
    if aio.use_gds and use == "states":
        log.warning(
            "zengine: aio.use_gds: GPUDirect Storage is not available in zoffload; NVMe "
            "offload goes through host memory"
        )
    return zoffload.Offloader(
        pool=zoffload.default_pool(),
        io_threads=aio.requests_in_flight,
        chunk_bytes=aio.chunk_bytes,
    )
