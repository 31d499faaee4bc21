"""``deepspeed.moe.layer``: DeepSpeed's expert-parallel `MoE` layer, refused where it is built;
importable, as DeepSpeed's test helpers import it at module level."""

from deepspeed._refused import EXPERT_PARALLEL, refused

__all__ = ["MoE"]

MoE = refused("deepspeed.moe.layer.MoE", *EXPERT_PARALLEL)
