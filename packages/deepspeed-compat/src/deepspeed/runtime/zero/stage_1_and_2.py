"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's stage-1/2 optimizer is zengine's ZeRO
optimizer, which runs every stage."""

from zengine import ZeroOptimizer as DeepSpeedZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer"]
