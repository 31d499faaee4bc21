"""``deepspeed.runtime.zero.offload_config``: zoffload's enums (str enums, DeepSpeed's values)."""

from zoffload import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
