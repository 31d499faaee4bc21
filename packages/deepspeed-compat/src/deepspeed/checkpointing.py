"""``deepspeed.checkpointing``: DeepSpeed's activation checkpointing (zengine.checkpointing)."""

from zengine.checkpointing import *  # noqa: F403 - the whole module, as DeepSpeed's
from zengine.checkpointing import __all__ as __all__
