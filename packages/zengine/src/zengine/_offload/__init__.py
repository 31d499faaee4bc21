"""Offload: the engine's state on the host or on NVMe, and host memory given back.

Owns ``offload_optimizer: nvme`` (the masters and the optimizer state in files between steps,
_optimizer.py), the gradient partition in files between the boundary's backward and a tiled step
(_grads.py), ``offload_param: nvme`` (ZeRO-3 shards in files while released, _param.py),
``engine.offload_states`` / ``reload_states`` (_states.py), the NVMe offloader the ``aio``
section sets (_aio.py), and freed host memory handed back to the system (_host_memory.py). The
bytes move through zoffload; the tensors moved are the optimizer's and the model's.
"""

from zengine._offload._agree import agree_on_folders, agree_on_outcome, agree_on_swaps
from zengine._offload._aio import nvme_offloader
from zengine._offload._grads import GradientSwap
from zengine._offload._host_memory import IdleTrimmer, trim_heap, zero_releasing_pages
from zengine._offload._optimizer import NvmeStateSwapper
from zengine._offload._param import NvmeShardStore
from zengine._offload._states import (
    StateOffloader,
    StatesEngine,
    StatesOptimizer,
    get_state_devices,
    memory_held,
)

__all__ = [
    "GradientSwap",
    "IdleTrimmer",
    "NvmeShardStore",
    "NvmeStateSwapper",
    "StateOffloader",
    "StatesEngine",
    "StatesOptimizer",
    "agree_on_folders",
    "agree_on_outcome",
    "agree_on_swaps",
    "get_state_devices",
    "memory_held",
    "nvme_offloader",
    "trim_heap",
    "zero_releasing_pages",
]
