"""The errors checkpoint saving and loading raise: each names the checkpoint and what is wrong."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "ClientStateError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; a failed save leaves the last good one."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files are missing, incomplete or do not match their checksums."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint file asks for an object zstack does not load, since unpickling it could run
    code; the message names the file and the type."""


class ClientStateError(CheckpointError, TypeError):
    """``save_checkpoint``'s client_state holds something other than plain data (see
    _client_state.py); the message names where in it and the type. Nothing was saved."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint was saved from another model or optimizer config; the message lists what
    differs."""


class CheckpointTagError(CheckpointError, AssertionError):
    """The ranks passed different tags to ``save_checkpoint`` under ``tag_validation: FAIL``
    (also an AssertionError, which DeepSpeed raises there)."""
