"""``deepspeed.runtime.lr_schedules``: zengine's schedules, and DeepSpeed's list of their names
(Accelerate tells a DeepSpeed scheduler by ``type(obj).__name__ in VALID_LR_SCHEDULES``)."""

from zengine import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

__all__ = [
    "VALID_LR_SCHEDULES",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
