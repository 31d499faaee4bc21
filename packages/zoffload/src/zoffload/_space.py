"""NVMe folders checked before a byte moves: there, a directory, writable, with room.

`inspect_folder` says what is wrong with a folder for writing ``needed`` bytes (or nothing),
without raising, so that ranks can compare their answers before any of them moves state;
`check_folder` raises the `NvmeError` it describes. `nvme_error` turns the `OSError` of a
write into the same named errors, naming the path and, for a full disk, the bytes.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from zoffload import _deferred
from zoffload._errors import NvmeError, NvmeSpaceError

__all__ = [
    "FolderCheck",
    "check_folder",
    "free_bytes",
    "free_bytes_now",
    "inspect_folder",
    "nvme_error",
]


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (or of its
    nearest existing parent); None where it cannot be told. Files this process deleted count
    as free: their blocks are freed first ([Note: deferred free] in ``_nvme``)."""
    _deferred.wait()
    return free_bytes_now(path)


def free_bytes_now(path: str | os.PathLike[str]) -> int | None:
    """`free_bytes` without waiting for the deleted files' blocks (at most what it says)."""
    here = Path(path)
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        st = os.statvfs(here)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class FolderCheck:
    """What `inspect_folder` found: ``problem`` is None when ``needed`` bytes can be written.

    ``device`` identifies the filesystem on this host (``st_dev``; -1 when unknown), so that
    several writers sharing one can add up what they need.
    """

    path: Path
    needed: int
    free: int | None
    device: int
    problem: str | None = None
    space: bool = False  # the problem is a lack of space

    def error(self) -> NvmeError:
        """The named error for ``problem``."""
        assert self.problem is not None
        kind = NvmeSpaceError if self.space else NvmeError
        needed = self.needed if self.space else None
        return kind(self.path, self.problem, needed=needed, free=self.free)


def inspect_folder(path: str | os.PathLike[str], needed: int = 0) -> FolderCheck:
    """Make ``path`` (and its parents) if missing, and check it is a writable directory with
    ``needed`` bytes free. Never raises for what it finds: see `FolderCheck.problem`."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return FolderCheck(folder, needed, free_bytes(folder), -1, "not a directory")
    except OSError as error:
        found = nvme_error(folder, error)
        return FolderCheck(folder, needed, free_bytes(folder), -1, found.problem)
    if not folder.is_dir():
        return FolderCheck(folder, needed, free_bytes(folder), -1, "not a directory")
    device = os.stat(folder).st_dev
    try:
        st = os.statvfs(folder)
    except OSError as error:
        return FolderCheck(folder, needed, None, device, nvme_error(folder, error).problem)
    free = st.f_bavail * st.f_frsize
    if st.f_flag & os.ST_RDONLY:
        return FolderCheck(folder, needed, free, device, "the filesystem is read-only")
    if not os.access(folder, os.W_OK | os.X_OK):  # root passes: only the mode bits of others
        return FolderCheck(folder, needed, free, device, "no permission to write")
    if needed > free:
        return FolderCheck(folder, needed, free, device, "not enough free space", space=True)
    return FolderCheck(folder, needed, free, device)


def check_folder(path: str | os.PathLike[str], needed: int = 0) -> Path:
    """`inspect_folder`, raising its `NvmeError` (`NvmeSpaceError` for space); the folder."""
    found = inspect_folder(path, needed)
    if found.problem is not None:
        raise found.error()
    return found.path


def nvme_error(path: Path, error: OSError, *, needed: int | None = None) -> NvmeError:
    """The named error for an `OSError` of a write under ``path``: a full disk (or quota)
    becomes `NvmeSpaceError` with the space left."""
    reason = error.strerror or str(error)
    code = error.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        problem = f"out of space while writing ({reason})"
        return NvmeSpaceError(path, problem, needed=needed, free=free_bytes(path))
    if code == errno.EFBIG:  # a file size limit (ulimit -f, the filesystem's), not the disk
        return NvmeError(path, f"the file may not grow that large ({reason})", needed=needed)
    if code == errno.EROFS:
        return NvmeError(path, "the filesystem is read-only")
    if code in (errno.EACCES, errno.EPERM):
        return NvmeError(path, f"no permission to write ({reason})")
    if code == errno.ENOTDIR:
        return NvmeError(path, "not a directory (or one of its parents is a file)")
    return NvmeError(path, f"{reason} (errno {code})")
