"""``offload_param: {device: nvme}``: ZeRO-3 shards in files while their module is not running.

zpartition hands a unit's shard here when it releases the unit and asks for it back before the
next all-gather (its `ShardStore` protocol). A shard is written only when its bytes changed
since they were last written (the optimizer step changes them, a forward does not), so a
training step reads every shard once or twice and writes each once. The files live in a
folder of their own under ``nvme_path``, removed when the engine is destroyed; they are scratch
space for this process, not a checkpoint.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["NvmeShardStore"]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The host bytes of a contiguous CPU tensor, writable, without a copy."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


class NvmeShardStore:
    """Shards kept in one file each under a private folder of `nvme_path`."""

    def __init__(self, nvme_path: str | os.PathLike[str], rank: int) -> None:
        Path(nvme_path).mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix=f"zengine-params-rank{rank}-", dir=nvme_path))
        self._files: dict[int, tuple[Path, int]] = {}  # id(shard) -> (file, version written)
        self._sizes: dict[int, int] = {}  # id(shard) -> its bytes
        # the files go when the store does, or at exit, whichever comes first
        self._remove = weakref.finalize(self, shutil.rmtree, self.folder, True)

    def evict(self, shard: torch.Tensor) -> None:
        storage = shard.untyped_storage()
        if storage.nbytes() == 0:
            return  # away already
        if shard.device.type != "cpu":
            raise ValueError("offload_param to NVMe keeps shards on the host; this one is not")
        key = id(shard)
        written = self._files.get(key)
        if written is None or written[1] != shard._version:
            path = written[0] if written is not None else self.folder / f"shard-{len(self._files)}"
            self._write(path, _bytes_of(shard))
            self._files[key] = (path, shard._version)
        self._sizes[key] = storage.nbytes()
        storage.resize_(0)

    def fetch(self, shards: Sequence[torch.Tensor]) -> None:
        for shard in shards:
            storage = shard.untyped_storage()
            key = id(shard)
            if storage.nbytes() != 0 or key not in self._files:
                continue
            storage.resize_(self._sizes[key])
            self._read(self._files[key][0], _bytes_of(shard))

    @staticmethod
    def _write(path: Path, data: memoryview) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        finally:
            os.close(fd)

    @staticmethod
    def _read(path: Path, into: memoryview) -> None:
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < len(into):
                got = f.readinto(into[done:])
                if not got:
                    raise OSError(
                        f"offload_param: {path} is shorter than its shard ({len(into)} bytes)"
                    )
                done += got

    def close(self) -> None:
        """Remove the files (the engine is done with the shards)."""
        self._remove()
        self._files.clear()
