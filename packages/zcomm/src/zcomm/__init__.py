"""torch.distributed underneath zstack: groups, collectives, p2p, nodes, topology, accelerator.

``import zcomm as dist`` stands in for ``deepspeed.comm``; `get_accelerator` for DeepSpeed's;
`zcomm.topology` for its pipeline topology; `zcomm.testing` holds the distributed test harness.
`set_activity` records the engine call each rank runs, and the watchdog names a rank that
stops answering (`RankUnresponsiveError`) or ranks out of step (`RanksOutOfStepError`).
`quantize` and `dequantize` pack a tensor into int8 or int4 blocks for quantized communication;
`all_gather_quantized` and `reduce_scatter_quantized` are ZeRO++'s collectives built on them.
"""

from zcomm.__about__ import __version__
from zcomm._accelerator import Accelerator, get_accelerator
from zcomm._accounting import (
    CommOpStats,
    comm_bytes_by_link,
    comm_summary,
    enable_comm_accounting,
    log_summary,
    reset_comm_accounting,
)
from zcomm._collectives import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    inference_all_reduce,
    reduce,
    reduce_scatter_tensor,
)
from zcomm._errors import CommError, CommTimeoutError
from zcomm._groups import get_axis_group, new_group
from zcomm._handle import Handle
from zcomm._nodes import (
    NodeLayout,
    TopologyError,
    inter_node_group,
    intra_node_group,
    node_layout,
    set_node_layout,
)
from zcomm._objects import all_gather_object
from zcomm._p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from zcomm._quantize import (
    QuantizationError,
    Quantized,
    dequantize,
    quantize,
    quantized_nbytes,
)
from zcomm._quantized_collectives import (
    all_gather_quantized,
    quantized_collective_nbytes,
    reduce_scatter_quantized,
)
from zcomm._watchdog import (
    ACTIVITY as current_activity,
)
from zcomm._watchdog import (
    CALLS,
    Activity,
    RanksOutOfStepError,
    RankUnresponsiveError,
    set_activity,
    set_watchdog,
    watchdog_seconds,
)
from zcomm._world import (
    destroy,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)

__all__ = [
    "CALLS",
    "Accelerator",
    "Activity",
    "CommError",
    "CommOpStats",
    "CommTimeoutError",
    "Handle",
    "NodeLayout",
    "P2POp",
    "QuantizationError",
    "Quantized",
    "RankUnresponsiveError",
    "RanksOutOfStepError",
    "ReduceOp",
    "TopologyError",
    "__version__",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_quantized",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "comm_bytes_by_link",
    "comm_summary",
    "current_activity",
    "dequantize",
    "destroy",
    "enable_comm_accounting",
    "get_accelerator",
    "get_axis_group",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "inference_all_reduce",
    "init_distributed",
    "inter_node_group",
    "intra_node_group",
    "irecv",
    "is_initialized",
    "isend",
    "log_summary",
    "new_group",
    "node_layout",
    "quantize",
    "quantized_collective_nbytes",
    "quantized_nbytes",
    "recv",
    "reduce",
    "reduce_scatter_quantized",
    "reduce_scatter_tensor",
    "reset_comm_accounting",
    "send",
    "set_activity",
    "set_node_layout",
    "set_watchdog",
    "watchdog_seconds",
]
