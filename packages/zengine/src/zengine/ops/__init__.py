"""``zengine.ops``: DeepSpeed's optimizer classes (``deepspeed.ops.adam``,
``deepspeed.ops.adagrad``) on torch's fused kernels, so scripts that build them keep working
with the imports changed."""

from zengine.ops import adagrad, adam

__all__ = ["adagrad", "adam"]
