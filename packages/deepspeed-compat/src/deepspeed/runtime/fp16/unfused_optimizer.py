"""``deepspeed.runtime.fp16.unfused_optimizer``: DeepSpeed's fp16 optimizer that keeps a master
per parameter (for optimizers it cannot fuse). zengine's stage-0 masters are always flat per
group (`FP16_Optimizer`), so no zengine optimizer is one (an ``isinstance`` test that holds for
none; see deepspeed/runtime/_optimizer_kinds.py)."""

from deepspeed.runtime._optimizer_kinds import optimizer_kind

FP16_UnfusedOptimizer = optimizer_kind(
    "FP16_UnfusedOptimizer",
    "never: its stage-0 masters are flat per group (FP16_Optimizer)",
    lambda o: False,
)

__all__ = ["FP16_UnfusedOptimizer"]
