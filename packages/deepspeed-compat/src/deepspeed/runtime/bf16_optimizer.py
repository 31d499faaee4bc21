"""``deepspeed.runtime.bf16_optimizer``: DeepSpeed's optimizer for bf16 at ZeRO stages 0 and 1
is zengine's one ZeRO optimizer, which holds the fp32 masters at every stage."""

from zengine import ZeroOptimizer as BF16_Optimizer

__all__ = ["BF16_Optimizer"]
