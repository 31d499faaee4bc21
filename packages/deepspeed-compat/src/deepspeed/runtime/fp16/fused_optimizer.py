"""``deepspeed.runtime.fp16.fused_optimizer``: DeepSpeed's fp16 optimizer at ZeRO stage 0 is
zengine's one ZeRO optimizer, which holds the fp32 masters and the loss scale at every stage
(so ``isinstance`` checks against it hold)."""

from zengine import ZeroOptimizer as FP16_Optimizer

__all__ = ["FP16_Optimizer"]
