"""The errors zcomm raises when communication fails: they name the operation, group and rank."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["CommError", "CommTimeoutError", "comm_error", "describe_group"]


class CommError(RuntimeError):
    """A collective or point-to-point operation failed.

    The message names the operation, the process group and this process's rank, so that a
    log of many ranks says which call broke where; the torch error is kept as ``__cause__``.
    """

    def __init__(self, op: str, group: str, rank: int, detail: str) -> None:
        self.op = op
        self.group = group
        self.rank = rank
        super().__init__(f"{op} on {group} failed on rank {rank}: {detail}")


class CommTimeoutError(CommError):
    """A collective did not complete within the process group's timeout."""


def describe_group(group: dist.ProcessGroup | None) -> str:
    """A short human name for a group: ``the world group (4 ranks)`` or ``group ranks [0, 2]``."""
    if not dist.is_initialized():
        return "no process group (not initialized)"
    if group is None or group is dist.group.WORLD:
        return f"the world group ({dist.get_world_size()} ranks)"
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return "an unknown group"
    return f"group ranks {ranks}"


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _looks_like_timeout(message: str) -> bool:
    lowered = message.lower()
    return "timed out" in lowered or "timeout" in lowered


def comm_error(op: str, group: dist.ProcessGroup | None, cause: BaseException) -> CommError:
    """Wrap a torch error raised by ``op`` into a `CommError` (or `CommTimeoutError`)."""
    detail = str(cause).strip() or type(cause).__name__
    if "closed by peer" in detail.lower() or "connection reset" in detail.lower():
        # Gloo reports a dead peer as a closed socket; say what that usually means.
        detail += " (a peer rank probably exited or crashed)"
    kind = CommTimeoutError if _looks_like_timeout(detail) else CommError
    return kind(op, describe_group(group), _global_rank(), detail)
