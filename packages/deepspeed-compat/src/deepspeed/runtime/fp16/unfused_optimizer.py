"""``deepspeed.runtime.fp16.unfused_optimizer``: DeepSpeed's fp16 optimizer without flat buffers
(for LAMB, and bf16 at stage 0 with a client optimizer) is zengine's one ZeRO optimizer too."""

from zengine import ZeroOptimizer as FP16_UnfusedOptimizer

__all__ = ["FP16_UnfusedOptimizer"]
