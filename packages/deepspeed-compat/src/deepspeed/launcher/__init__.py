"""``deepspeed.launcher``: zstack launches with torchrun; `runner` keeps DeepSpeed's constants."""

from deepspeed.launcher import runner

__all__ = ["runner"]
