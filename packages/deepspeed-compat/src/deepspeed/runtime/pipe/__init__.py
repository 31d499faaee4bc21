"""``deepspeed.runtime.pipe``: schedules (zpipe), topology (zcomm), the module and engine
(zengine.pipe)."""

from deepspeed.runtime.pipe import engine, module, schedule, topology
from zengine.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = [
    "LayerSpec",
    "PipelineModule",
    "TiedLayerSpec",
    "engine",
    "module",
    "schedule",
    "topology",
]
