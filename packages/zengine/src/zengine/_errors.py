"""Errors the engine raises for a call it refuses as made."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(RuntimeError, AssertionError):
    """A call the engine refuses as used (``no_sync`` misuse, a step with unused parameters
    when they are not to be ignored); also an AssertionError, which DeepSpeed's engine raises
    there and its users' tests expect."""
