"""Swap folders: one per process and use under an NVMe path, marked as ours, so that the files
of a job that was killed are found and removed by the next one.

[Note: swap folders]
Offload files are scratch space for the process that wrote them. A process that exits
normally removes its swap folders (atexit; the engine's stores do so when destroyed), but a
killed one cannot. So every swap file lives in a folder made by `claim_folder`,
``<parent>/<prefix>-<host>-<pid>-<random>``, holding a marker file (``.zoffload-owner``: JSON
with our name, the host, the pid and the process's start time) that the owner keeps locked
(``flock``) for as long as it lives. `sweep_stale`, run when a folder is claimed under the
same parent (the next start that uses the path), removes a marked folder only when

- the marker is ours and names this host (a folder of another machine on a shared
  filesystem is left alone: whether its owner lives cannot be told from here),
- its pid is not running here, or runs a process started at another time (a reused pid), and
- its lock can be taken: the kernel drops a dead process's locks, and a live process holds its
  own even in another PID namespace with the same hostname (a container), so two live ranks
  that share a path never remove each other's files.

Files and folders without our marker are never touched, whatever their names.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import threading
import uuid
from pathlib import Path

from zoffload._space import check_folder

__all__ = ["MARKER", "claim_folder", "claimed", "release_folder", "sweep_stale"]

_log = logging.getLogger("zoffload")

MARKER = ".zoffload-owner"
_OWNER = "zoffload"
_lock = threading.Lock()
_claimed: dict[Path, int] = {}  # folders this process made -> the fd that holds the lock


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command name


def _alive(pid: int, started: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    now = _start_time(pid)
    return started is None or now is None or now == started


def claimed(folder: Path) -> bool:
    """Whether ``folder`` is a swap folder this process claimed."""
    with _lock:
        return folder in _claimed


def claim_folder(parent: str | os.PathLike[str], prefix: str) -> Path:
    """A new swap folder of this process under ``parent`` ([Note: swap folders]), after the
    stale ones of killed processes there are removed. Raises `NvmeError` when ``parent``
    cannot be written."""
    base = check_folder(parent)
    sweep_stale(base)
    pid = os.getpid()
    folder = base / f"{prefix}-{socket.gethostname()}-{pid}-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    marker = folder / MARKER
    fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        record = {
            "owner": _OWNER,
            "host": socket.gethostname(),
            "pid": pid,
            "started": _start_time(pid),
        }
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    with _lock:
        if not _claimed:
            atexit.register(_remove_own, pid)
        _claimed[folder] = fd
    return folder


def release_folder(folder: Path) -> None:
    """Remove a swap folder this process claimed, with whatever it holds."""
    with _lock:
        fd = _claimed.pop(folder, None)
    shutil.rmtree(folder, ignore_errors=True)
    if fd is not None:
        os.close(fd)


def _remove_own(pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child exiting: the folders are its parent's
    for folder in list(_claimed):
        release_folder(folder)


def sweep_stale(parent: str | os.PathLike[str]) -> list[Path]:
    """Remove the swap folders under ``parent`` whose process is gone ([Note: swap folders]),
    logging a warning for each with the bytes freed; returns them."""
    removed: list[Path] = []
    try:
        children = list(Path(parent).iterdir())
    except OSError:
        return removed
    host = socket.gethostname()
    for child in children:
        marker = child / MARKER
        if child.is_symlink() or not marker.is_file() or claimed(child):
            continue
        try:
            record = json.loads(marker.read_text())
            ours = record.get("owner") == _OWNER and record.get("host") == host
            pid, started = int(record["pid"]), record.get("started")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not a marker we wrote
        if not ours or _alive(pid, started):
            continue
        if _remove_if_unlocked(child, marker, pid):
            removed.append(child)
    return removed


def _remove_if_unlocked(folder: Path, marker: Path, pid: int) -> bool:
    try:
        fd = os.open(marker, os.O_RDONLY)
    except OSError:
        return False  # removed by another process sweeping at the same time
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its owner lives (in another PID namespace, say)
        files, nbytes = 0, 0
        for entry in folder.rglob("*"):
            with contextlib.suppress(OSError):
                st = entry.lstat()
                if not entry.is_dir() and entry != marker:
                    files += 1
                    nbytes += st.st_blocks * 512
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(fd)
    _log.warning(
        "zoffload: removed %s, the swap folder of process %d that is gone (killed?): "
        "%d files, %d bytes freed",
        folder,
        pid,
        files,
        nbytes,
    )
    return True
