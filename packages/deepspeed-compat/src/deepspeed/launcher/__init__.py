"""``deepspeed.launcher``: the ``deepspeed`` command (`runner`), the per-node launcher
(`launch`), DeepSpeed's runner classes (`multinode_runner`) and names (`constants`), on zcomm's
launcher (`zcomm.launch`: torchrun on each node, or one mpirun)."""

from deepspeed.launcher import runner

__all__ = ["runner"]
