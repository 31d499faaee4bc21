"""``deepspeed.runtime.pipe.engine``: zengine's pipeline engine."""

from zengine.pipe import PipelineEngine

__all__ = ["PipelineEngine"]
