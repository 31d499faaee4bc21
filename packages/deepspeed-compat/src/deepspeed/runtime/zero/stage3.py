"""``deepspeed.runtime.zero.stage3``: DeepSpeed's stage-3 optimizer is zengine's ZeRO optimizer
at stage 3 (an ``isinstance`` test; see deepspeed/runtime/_optimizer_kinds.py)."""

from deepspeed.runtime._optimizer_kinds import optimizer_kind

DeepSpeedZeroOptimizer_Stage3 = optimizer_kind(
    "DeepSpeedZeroOptimizer_Stage3", "running ZeRO stage 3", lambda o: o.stage == 3
)

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]
