"""``deepspeed.runtime.base_optimizer``: DeepSpeed's base of its ZeRO optimizers is zengine's one
ZeRO optimizer (stages 0-3), so ``isinstance`` checks against it hold."""

from zengine import ZeroOptimizer as ZeROOptimizer

__all__ = ["ZeROOptimizer"]
