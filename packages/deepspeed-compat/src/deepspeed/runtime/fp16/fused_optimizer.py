"""``deepspeed.runtime.fp16.fused_optimizer``: DeepSpeed's fp16 (and bf16) optimizer without
ZeRO is zengine's ZeRO optimizer at stage 0 over fp16 or bf16 parameters, whose fp32 masters
are flat per group, as this class's (an ``isinstance`` test; see _optimizer_kinds.py)."""

from deepspeed.runtime._optimizer_kinds import half_precision, optimizer_kind

FP16_Optimizer = optimizer_kind(
    "FP16_Optimizer",
    "running ZeRO stage 0 over fp16 or bf16 parameters",
    lambda o: o.stage == 0 and half_precision(o),
)

__all__ = ["FP16_Optimizer"]
