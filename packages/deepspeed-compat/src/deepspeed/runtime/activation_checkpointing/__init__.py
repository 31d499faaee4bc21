"""``deepspeed.runtime.activation_checkpointing``."""

from deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
