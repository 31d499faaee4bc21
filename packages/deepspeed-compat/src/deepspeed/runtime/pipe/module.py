"""``deepspeed.runtime.pipe.module``: zengine's pipeline module and layer specs."""

from zengine.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
