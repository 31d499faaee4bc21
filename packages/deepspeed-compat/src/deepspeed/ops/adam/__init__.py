"""``deepspeed.ops.adam``: zengine.ops.adam."""

from zengine.ops.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
