"""``zengine.checkpointing``: DeepSpeed's ``deepspeed.checkpointing``, activation checkpointing
for a model's own blocks: ``checkpoint``, ``reentrant_checkpoint``, ``configure`` and the rest of
DeepSpeed's names (see zengine/_recompute.py, where they are written and documented). Saving
and loading training state is ``engine.save_checkpoint`` (zengine/_checkpoint/), not this.
"""

from zengine._recompute import *  # noqa: F403 - DeepSpeed's names, at DeepSpeed's path
from zengine._recompute import __all__ as __all__
