"""Errors the engine raises for a call it refuses as made."""

from __future__ import annotations

__all__ = ["MissingArgumentError", "UsageError"]


class UsageError(RuntimeError, AssertionError):
    """A call the engine refuses as used (``no_sync`` misuse, a step with unused parameters
    when they are not to be ignored); also an AssertionError, which DeepSpeed's engine raises
    there and its users' tests expect."""


class MissingArgumentError(ValueError, AssertionError):
    """A call made without an argument it cannot do without (``initialize`` without a
    model); also an AssertionError, as DeepSpeed asserts it."""
