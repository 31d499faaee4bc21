"""Errors the engine raises for a call it refuses as made."""

from __future__ import annotations

__all__ = ["MissingArgumentError", "UsageError"]


class UsageError(RuntimeError, AssertionError):
    """A call or a combination the engine refuses as used (``no_sync`` misuse, a step with
    unused parameters when they are not to be ignored, a client optimizer with
    ``offload_optimizer``, an ``allgather_bucket_size`` DeepSpeed rejects). DeepSpeed's
    ``ZeRORuntimeException`` is this class (the compat package's name for it); also an
    AssertionError, which DeepSpeed's engine raises for most of these and its users' tests
    expect."""


class MissingArgumentError(ValueError, AssertionError):
    """A call made without an argument it cannot do without (``initialize`` without a
    model); also an AssertionError, as DeepSpeed asserts it."""
