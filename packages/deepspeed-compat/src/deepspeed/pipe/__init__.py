"""``deepspeed.pipe``: the pipeline module and layer specs (zengine.pipe)."""

from zcomm.topology import ProcessTopology
from zengine.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
