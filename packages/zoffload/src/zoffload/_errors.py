"""The errors zoffload raises; each names the tensor or the file it is about."""

from __future__ import annotations

from pathlib import Path

__all__ = ["OffloadChecksumError", "OffloadError", "OffloadFileError"]


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
