"""``deepspeed.moe``: expert parallelism, which zstack does not have (see `layer`)."""

from deepspeed.moe import layer

__all__ = ["layer"]
