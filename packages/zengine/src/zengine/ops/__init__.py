"""``zengine.ops``: DeepSpeed's optimizer classes (``deepspeed.ops.adam``,
``deepspeed.ops.adagrad``, ``deepspeed.ops.lion``) on torch's fused kernels, so scripts that
build them keep working with the imports changed."""

from zengine.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
