"""The errors zoffload raises; each names the tensor or the file it is about."""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "NvmeError",
    "NvmeSpaceError",
    "OffloadChecksumError",
    "OffloadError",
    "OffloadFileError",
]


class OffloadError(RuntimeError):
    """An offload or reload could not be done (bad argument, wrong state, failed copy)."""


class OffloadFileError(OffloadError):
    """An NVMe offload file is missing, truncated, corrupt or not a zoffload file.

    ``path`` is the file; the message names it and says what is wrong with it.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"offload file {self.path}: {problem}")


class OffloadChecksumError(OffloadError):
    """Reloaded bytes differ from the bytes that were offloaded (``verify=True``).

    ``names`` are the tensors whose storage came back different.
    """

    def __init__(self, names: list[str], detail: str) -> None:
        self.names = names
        super().__init__(f"reloaded bytes differ from the offloaded ones for {names}: {detail}")


class NvmeError(OffloadError):
    """An NVMe offload folder or file could not be written: read-only, not a directory, no
    permission, an I/O error. Nothing moved: the tensors hold their bytes, no partial file
    remains.

    ``path`` is the folder or file, ``problem`` what went wrong; ``needed`` and ``free`` are the
    bytes to write and the bytes free there when known (else None). ``message`` replaces the
    default text (the engine gives every rank the same one).
    """

    def __init__(
        self,
        path: str | Path,
        problem: str,
        *,
        needed: int | None = None,
        free: int | None = None,
        message: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.problem = problem
        self.needed = needed
        self.free = free
        if message is None:
            message = f"NVMe offload to {self.path}: {problem}"
            if needed is not None:
                message += f" ({amount(needed)} to write"
                message += ")" if free is None else f", {amount(free)} free)"
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:  # picklable with its keyword arguments
        return (_rebuild, (type(self), self.path, self.problem, self.needed, self.free, str(self)))


class NvmeSpaceError(NvmeError):
    """Not enough free space for an NVMe offload (checked before a byte is written, or a write
    that ran out of space); ``needed`` and ``free`` say by how much."""


def _rebuild(
    cls: type[NvmeError], path: Path, problem: str, needed: int | None, free: int | None, msg: str
) -> NvmeError:
    return cls(path, problem, needed=needed, free=free, message=msg)


def amount(nbytes: int | None) -> str:
    if nbytes is None:
        return "unknown"
    if nbytes < 1 << 20:
        return f"{nbytes} bytes"
    return f"{nbytes} bytes ({nbytes / (1 << 20):.1f} MiB)"
