"""Pipeline parallelism: ``zengine.pipe`` stands in for ``deepspeed.pipe``.

Build a `PipelineModule` from layers (`LayerSpec`, `TiedLayerSpec`, modules, callables), pass
it to ``zengine.initialize``, and train with ``engine.train_batch(data_iter)``; the config's
``pipeline.schedule`` picks the zpipe schedule (1F1B, GPipe, interleaved, zero-bubble).
"""

from zengine.pipe._engine import SCHEDULES, PipelineEngine
from zengine.pipe._errors import PipelineError
from zengine.pipe._initialize import initialize_pipeline
from zengine.pipe._module import PipelineModule
from zengine.pipe._partition import partition_balanced, partition_uniform
from zengine.pipe._specs import LayerSpec, TiedLayerSpec

__all__ = [
    "SCHEDULES",
    "LayerSpec",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "TiedLayerSpec",
    "initialize_pipeline",
    "partition_balanced",
    "partition_uniform",
]
