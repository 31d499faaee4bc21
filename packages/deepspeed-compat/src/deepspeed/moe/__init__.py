"""``deepspeed.moe``: expert parallelism, which zstack does not have (see `layer`); `utils`'
parameter-group split, which models without expert-parallel parameters pass through as they
are."""

from deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
