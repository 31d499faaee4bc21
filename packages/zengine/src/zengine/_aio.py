"""The offloader NVMe offload reads and writes through: the config's ``aio`` settings, or
zoffload's own defaults where the config has no such section."""

from __future__ import annotations

import functools
import logging

import zoffload
from zengine._config_sections import AioConfig

__all__ = ["nvme_offloader"]

log = logging.getLogger("zengine")


@functools.cache  # one per setting: engines alike share its threads
def nvme_offloader(aio: AioConfig | None) -> zoffload.Offloader:
    if aio is None:
        return zoffload.default_offloader()
    if aio.use_gds:
        log.warning(
            "zengine: aio.use_gds: GPUDirect Storage is not available in zoffload; NVMe "
            "offload goes through host memory"
        )
    return zoffload.Offloader(io_threads=aio.requests_in_flight, chunk_bytes=aio.chunk_bytes)
