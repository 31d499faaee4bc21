"""``deepspeed.runtime.activation_checkpointing.checkpointing``: zengine.checkpointing."""

from zengine.checkpointing import (
    checkpoint,
    configure,
    is_configured,
    non_reentrant_checkpoint,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
)

__all__ = [
    "checkpoint",
    "configure",
    "is_configured",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]
