"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's stage 1-2 optimizer is zengine's ZeRO
optimizer at stage 1 or 2 (an ``isinstance`` test; see deepspeed/runtime/_optimizer_kinds.py)."""

from deepspeed.runtime._optimizer_kinds import optimizer_kind

DeepSpeedZeroOptimizer = optimizer_kind(
    "DeepSpeedZeroOptimizer", "running ZeRO stage 1 or 2", lambda o: o.stage in (1, 2)
)

__all__ = ["DeepSpeedZeroOptimizer"]
