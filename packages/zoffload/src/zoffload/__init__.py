"""Training state to pinned host memory or NVMe and back, bit-exact, with a CuPy path on CUDA.

``handle = zoffload.offload({"w": w, "m": m}, "cpu")`` empties the tensors' storages (the
same objects stay in the model and optimizer) and ``handle.reload()`` fills them again.
Importing zoffload never initializes CUDA; CuPy (the ``cuda`` extra) is used when present.
"""

from zoffload.__about__ import __version__
from zoffload._enums import OffloadDeviceEnum, OffloadStateTypeEnum
from zoffload._errors import (
    NvmeError,
    NvmeSpaceError,
    OffloadChecksumError,
    OffloadError,
    OffloadFileError,
)
from zoffload._handle import OffloadHandle
from zoffload._nvme import FileManifest, StorageEntry, check_file
from zoffload._offloader import Offloader, default_offloader, offload
from zoffload._pages import release_pages
from zoffload._pool import HostPool, HostRegion, PoolStats, default_pool
from zoffload._registry import handle_of
from zoffload._space import FolderCheck, check_folder, free_bytes, inspect_folder
from zoffload._stats import NvmeStats, nvme_stats
from zoffload._swapdir import claim_folder, release_folder, sweep_stale

__all__ = [
    "FileManifest",
    "FolderCheck",
    "HostPool",
    "HostRegion",
    "NvmeError",
    "NvmeSpaceError",
    "NvmeStats",
    "OffloadChecksumError",
    "OffloadDeviceEnum",
    "OffloadError",
    "OffloadFileError",
    "OffloadHandle",
    "OffloadStateTypeEnum",
    "Offloader",
    "PoolStats",
    "StorageEntry",
    "__version__",
    "check_file",
    "check_folder",
    "claim_folder",
    "default_offloader",
    "default_pool",
    "free_bytes",
    "handle_of",
    "inspect_folder",
    "nvme_stats",
    "offload",
    "release_folder",
    "release_pages",
    "sweep_stale",
]
