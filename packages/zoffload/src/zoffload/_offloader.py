"""`Offloader`: the pool, the NVMe I/O threads and the settings behind `offload`."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from zoffload import _cuda, _registry
from zoffload._enums import OffloadDeviceEnum
from zoffload._errors import OffloadError
from zoffload._handle import OffloadHandle
from zoffload._layout import plan
from zoffload._nvme import NvmeIO
from zoffload._pool import HostPool, default_pool
from zoffload._storage import collect, storage_key
from zoffload._swapdir import claim_folder, claimed

__all__ = ["Offloader", "default_offloader", "offload"]

_files = itertools.count()  # file numbers, unique within the process


class Offloader:
    """Offloads named tensors to host memory or NVMe; one per process is usually enough.

    Args:
        pool: host memory to use (default: the process-wide `default_pool`).
        nvme_path: default directory for ``device=nvme`` files.
        io_threads: NVMe requests in flight at once.
        chunk_bytes: size of one NVMe request (a multiple of 4096).
        direct_io: ``None`` uses O_DIRECT where the filesystem allows it, ``True`` requires
            it, ``False`` never uses it.
        small_bytes: storages smaller than this on a GPU are packed into shared transfers.
        pack_bytes: the largest packed transfer.
    """

    def __init__(
        self,
        *,
        pool: HostPool | None = None,
        nvme_path: str | os.PathLike[str] | None = None,
        io_threads: int = 4,
        chunk_bytes: int = 8 << 20,
        direct_io: bool | None = None,
        small_bytes: int = 1 << 20,
        pack_bytes: int = 64 << 20,
    ) -> None:
        self.pool = pool if pool is not None else default_pool()
        self.nvme_path = None if nvme_path is None else Path(nvme_path)
        self.io = NvmeIO(self.pool, threads=io_threads, chunk_bytes=chunk_bytes, direct=direct_io)
        self.small_bytes = small_bytes
        self.pack_bytes = pack_bytes
        self._driver: ThreadPoolExecutor | None = None  # runs non-blocking NVMe transfers
        self._lock = threading.Lock()
        self._folders: dict[tuple[int, Path], Path] = {}  # (pid, nvme_path) -> swap folder

    def offload(
        self,
        tensors: Mapping[str, torch.Tensor],
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        *,
        pin_memory: bool = True,
        non_blocking: bool = False,
        nvme_path: str | os.PathLike[str] | None = None,
        verify: bool = False,
        commit: bool = True,
        durable: bool = True,
    ) -> OffloadHandle:
        """Move the bytes of ``tensors`` to ``device`` and empty their storages.

        Args:
            tensors: name -> tensor (CPU or CUDA, dense). Views sharing a storage move it
                once; every view of it, named or not, is empty until reload.
            device: ``cpu`` (host memory from the pool), ``nvme`` (a file under
                ``nvme_path``) or ``none`` (drop the bytes: reload gives the memory back
                uninitialised, as DeepSpeed does for its contiguous gradient buffer).
            pin_memory: page-lock the host memory (only meaningful with CUDA tensors;
                ordinary memory without CUDA).
            non_blocking: return before the copies finish; `OffloadHandle.wait` waits.
            nvme_path: directory for ``device=nvme`` (default: the offloader's).
            verify: hash every storage now and check the reloaded bytes against it.
            commit: ``False`` (``device=nvme`` only): write the file but keep the bytes in
                the tensors, the handle ``written``, until `OffloadHandle.commit` empties them
                or `OffloadHandle.abandon` drops the file (ranks that must all move or none
                agree in between; the tensors must not change meanwhile).
            durable: ``False`` (``device=nvme``): a scratch file only this process reads
                back, written without fsync, at this offload and every rewrite of the
                handle ([Note: scratch files] in ``_nvme``).

        Returns:
            The handle to wait on and to `OffloadHandle.reload` from.
        """
        device = OffloadDeviceEnum(device)
        slots = collect(tensors)
        for slot in slots:
            holder = _registry.find(storage_key(slot.tensors[0]))
            if holder is not None and holder.offloaded:
                raise OffloadError(f"{slot.label!r} is already offloaded by {holder!r}")
        if not commit and device != OffloadDeviceEnum.nvme:
            raise ValueError("commit=False is for device=nvme (a file written, bytes kept)")
        if verify and device == OffloadDeviceEnum.none:
            raise ValueError("verify=True needs a copy to check: not with device=none")
        has_cuda = any(s.device.type == "cuda" for s in slots)
        pinned = pin_memory and has_cuda and _cuda.cuda_available()
        layout = plan(slots, small_bytes=self.small_bytes, pack_bytes=self.pack_bytes)
        handle = OffloadHandle(
            self,
            dict(tensors),
            slots,
            layout,
            device,
            pinned=pinned,
            verify=verify,
            durable=durable,
        )
        handle._hold = not commit
        file = self._new_file(nvme_path) if device == OffloadDeviceEnum.nvme else None
        handle._offload(non_blocking=non_blocking, nvme_file=file)
        return handle

    def _new_file(self, nvme_path: str | os.PathLike[str] | None) -> Path:
        """A new file name in this process's swap folder under the path ([Note: swap
        folders]; a folder this process claimed is used as it is)."""
        directory = Path(nvme_path) if nvme_path is not None else self.nvme_path
        if directory is None:
            raise ValueError("device=nvme needs nvme_path (here or on the Offloader)")
        with self._lock:
            key = (os.getpid(), directory)  # a forked child claims its own
            folder = self._folders.get(key)
            if folder is None or not folder.is_dir():
                folder = directory if claimed(directory) else claim_folder(directory, "zoffload")
                self._folders[key] = folder
        return folder / f"zoffload-{os.getpid()}-{next(_files):06d}.swap"

    def background(self, job: Callable[[], None]) -> Future[None]:
        """Run ``job`` on the offloader's driver thread (non-blocking NVMe transfers)."""
        with self._lock:
            if self._driver is None:
                self._driver = ThreadPoolExecutor(2, thread_name_prefix="zoffload-driver")
            return self._driver.submit(job)

    def close(self) -> None:
        """Stop the offloader's threads (handles in flight finish first)."""
        with self._lock:
            driver, self._driver = self._driver, None
        if driver is not None:
            driver.shutdown(wait=True)
        self.io.close()


_default: Offloader | None = None
_default_lock = threading.Lock()


def default_offloader() -> Offloader:
    """The process-wide offloader behind `offload` (it uses `default_pool`)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Offloader()
        return _default


def offload(
    tensors: Mapping[str, torch.Tensor],
    device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
    *,
    pin_memory: bool = True,
    non_blocking: bool = False,
    nvme_path: str | os.PathLike[str] | None = None,
    verify: bool = False,
    commit: bool = True,
    durable: bool = True,
) -> OffloadHandle:
    """`Offloader.offload` on the `default_offloader`: see there."""
    return default_offloader().offload(
        tensors,
        device,
        pin_memory=pin_memory,
        non_blocking=non_blocking,
        nvme_path=nvme_path,
        verify=verify,
        commit=commit,
        durable=durable,
    )
