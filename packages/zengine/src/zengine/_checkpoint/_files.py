"""A checkpoint directory on disk: tags, the ``latest`` pointer, the manifest and checksums.

[Note: a checkpoint is good or absent]
A save writes into ``<root>/.<tag>.partial``: DCP's per-rank files, then its ``.metadata``,
then our manifest ``zengine.json`` (what was saved and a CRC32 of every file). Only when all of
that is on disk (fsynced) does rank 0 rename the directory to ``<root>/<tag>`` and then
rewrite ``<root>/latest``, each by an atomic rename. A save that dies at any point leaves at
most a ``.partial`` directory, which no load ever reads, and ``latest`` still names the previous
checkpoint, whose files were never touched. Loads check the checksums, so a file damaged later
is named rather than silently loaded.

[Note: a killed save's .partial folder]
A save that is killed (the job's processes gone, no ``except`` run) leaves its ``.partial``
folder. Rank 0 writes a marker, ``zengine-partial.json`` (its host and process id), into the
folder as soon as it creates it, and removes the marker just before the rename. The next save
into the same save_dir removes every ``.partial`` folder holding that marker whose process is not
alive (on this host; one another host wrote is taken as dead: a save runs one job per save_dir),
and logs each. A folder ending in ``.partial`` without the marker is not ours and stays
(but for the tag being saved: its ``.<tag>.partial`` is where the save writes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import zlib
from pathlib import Path
from typing import Any

from zengine._checkpoint._ds_files import resolve_deepspeed
from zengine._checkpoint._errors import CorruptCheckpointError

__all__ = [
    "LATEST",
    "MANIFEST",
    "PARTIAL_MARKER",
    "abandoned_partials",
    "checksum",
    "partial_dir",
    "publish",
    "rank_files",
    "read_latest",
    "read_manifest",
    "resolve",
    "start_partial",
    "verify",
    "verify_checkpoint",
    "write_atomic",
]

LATEST = "latest"  # DeepSpeed's name: a text file holding the newest tag
MANIFEST = "zengine.json"
PARTIAL_MARKER = "zengine-partial.json"  # see [Note: a killed save's .partial folder]
_BLOCK = 8 << 20


def partial_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}.partial"


def start_partial(partial: Path) -> None:
    """Create the ``.partial`` folder of a save with our marker in it."""
    partial.mkdir()
    marker = {"host": socket.gethostname(), "pid": os.getpid()}
    (partial / PARTIAL_MARKER).write_text(json.dumps(marker))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def abandoned_partials(root: Path) -> list[tuple[Path, str]]:
    """The ``.partial`` folders in `root` that a save of ours began and whose process is gone,
    each with who wrote it (see [Note: a killed save's .partial folder])."""
    found = []
    for folder in sorted(root.glob(".*.partial")):
        try:
            marker = json.loads((folder / PARTIAL_MARKER).read_text())
            host, pid = str(marker["host"]), int(marker["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours (or not a folder)
        if host == socket.gethostname() and pid != os.getpid() and _alive(pid):
            continue  # a save still running in another process
        found.append((folder, f"process {pid} on {host}"))
    return found


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` so that a reader sees the old content or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def checksum(path: Path) -> tuple[int, int]:
    """(CRC32, size in bytes) of a file, read in blocks: memory stays at one block."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return crc, size


def rank_files(directory: Path, rank: int) -> list[Path]:
    """The files DCP wrote for `rank` (``__<rank>_<n>.distcp``)."""
    return sorted(directory.glob(f"__{rank}_*.distcp"))


def publish(partial: Path, final: Path) -> None:
    """Rename a complete ``.partial`` directory to its tag, replacing an older one of that tag."""
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def read_latest(root: Path) -> str | None:
    try:
        tag = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return tag or None


def resolve(path: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The directory of one checkpoint: `path` itself when it holds a manifest (or DeepSpeed's
    files), else its tag `tag` or the one ``latest`` names."""
    root = Path(path)
    deepspeed = resolve_deepspeed(root, tag)
    if deepspeed is not None:
        return deepspeed
    if tag is None and (root / MANIFEST).exists():
        return root
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            raise CorruptCheckpointError(
                f"{root}: no checkpoint here (no {MANIFEST}, and no '{LATEST}' file naming a tag)"
            )
    return root / tag


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint; an error naming what is missing otherwise."""
    path = directory / MANIFEST
    if not directory.is_dir():
        partial = partial_dir(directory.parent, directory.name)
        hint = (
            f" (only {partial.name} exists: that save did not finish)" if partial.exists() else ""
        )
        raise CorruptCheckpointError(f"checkpoint {directory} does not exist{hint}")
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        if not any(directory.glob("*.distcp")) and not (directory / ".metadata").exists():
            raise CorruptCheckpointError(
                f"{directory} is not a checkpoint: neither zstack's (no {MANIFEST}, no .distcp "
                "files) nor DeepSpeed's (no *_model_states.pt, no zero/optimizer_state.pt)"
            ) from None
        raise CorruptCheckpointError(
            f"checkpoint {directory} is incomplete: {MANIFEST} is missing (an interrupted save?)"
        ) from None
    except json.JSONDecodeError as error:
        raise CorruptCheckpointError(f"{path} is corrupt: {error}") from None
    problem = _malformed(manifest)
    if problem:
        raise CorruptCheckpointError(f"{path} is corrupt: {problem}")
    return manifest


def _malformed(manifest: Any) -> str | None:
    """What is wrong with a manifest's shape (the list of files every load checks), if any."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "it lists no files"
    if ".metadata" not in manifest["files"]:
        return "it does not list .metadata"
    for name, entry in manifest["files"].items():
        fields = entry.keys() if isinstance(entry, dict) else set()
        if not {"crc32", "bytes", "rank"} <= fields or not all(
            isinstance(entry[k], int) for k in ("crc32", "bytes", "rank")
        ):
            return f"its entry of {name!r} is not a CRC32, a size and a rank"
        if Path(name).name != name:
            return f"it lists {name!r}, which is not a file of the checkpoint's folder"
    return None


def verify(directory: Path, files: dict[str, Any], names: list[str]) -> list[str]:
    """Check the named files against the manifest's sizes and checksums; the problems found."""
    problems = []
    for name in names:
        expected = files[name]
        path = directory / name
        if not path.exists():
            problems.append(f"{path} is missing (written by rank {expected['rank']})")
            continue
        crc, size = checksum(path)
        if size != expected["bytes"]:
            problems.append(
                f"{path} has {size} bytes, the manifest says {expected['bytes']} "
                f"(written by rank {expected['rank']}; truncated?)"
            )
        elif crc != expected["crc32"]:
            problems.append(
                f"{path} is corrupt: CRC32 {crc:08x}, the manifest says {expected['crc32']:08x} "
                f"(written by rank {expected['rank']})"
            )
    return problems


def verify_checkpoint(directory: Path, manifest: dict[str, Any]) -> None:
    """Every file of the checkpoint against its manifest's size and CRC32, in this process
    (what ``load_checkpoint`` checks, over its ranks): `CorruptCheckpointError` naming each
    damaged or missing file."""
    problems = verify(directory, manifest["files"], sorted(manifest["files"]))
    if problems:
        raise CorruptCheckpointError("\n  ".join(problems))


def remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(path)
