"""``deepspeed.ops.lion``: zengine.ops.lion."""

from zengine.ops.lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
