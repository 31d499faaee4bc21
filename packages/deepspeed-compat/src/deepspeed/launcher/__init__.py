"""``deepspeed.launcher``: the ``deepspeed`` command (`runner`) and the per-node launcher
(`launch`), on zcomm's launcher (`zcomm.launch`: torchrun on each node)."""

from deepspeed.launcher import runner

__all__ = ["runner"]
