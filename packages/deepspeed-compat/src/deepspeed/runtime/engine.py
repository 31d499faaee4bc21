"""``deepspeed.runtime.engine``: zengine's engine is DeepSpeed's ``DeepSpeedEngine``."""

from zengine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
