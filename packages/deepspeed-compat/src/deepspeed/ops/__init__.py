"""``deepspeed.ops``: DeepSpeed's optimizer classes, on torch's fused kernels (zengine.ops)."""

from deepspeed.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
