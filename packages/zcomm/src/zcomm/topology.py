"""Process topologies and the pipeline grid (DeepSpeed's ``deepspeed.runtime.pipe.topology``)."""

from zcomm._grid import PipelineParallelGrid
from zcomm._topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    _prime_factors,
)

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessTopology",
    "_prime_factors",
]
