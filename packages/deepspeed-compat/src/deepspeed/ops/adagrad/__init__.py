"""``deepspeed.ops.adagrad``: zengine.ops.adagrad."""

from zengine.ops.adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
