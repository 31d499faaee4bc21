"""``deepspeed.runtime.zero.stage3``: DeepSpeed's stage-3 optimizer is zengine's ZeRO optimizer,
which runs every stage."""

from zengine import ZeroOptimizer as DeepSpeedZeroOptimizer_Stage3

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]
