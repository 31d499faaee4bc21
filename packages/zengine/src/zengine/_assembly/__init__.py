"""The assembly: the parts ``initialize`` builds an engine from, out of the config and the model.

`zengine.initialize` (zengine/_initialize.py) and the pipeline's `initialize_pipeline`
(pipe/_initialize.py) both put an engine together from these, and neither imports the other's
privates. Owns the parameter groups, the torch optimizer from the config or the caller, the loss
scaler and the LR scheduler (_optimizer.py), what DeepSpeed refuses at ``initialize``
(_refusals.py), and the model made ready: dense on the device or partitioned, with its shards
and masters where the offload sections put them (_model.py), its ZeRO-3 leaf modules marked
first (_leaf_config.py). The engines themselves, and the ZeRO optimizer, are not here.
"""

from zengine._assembly._hybrid import HybridGroups, hybrid_groups
from zengine._assembly._model import (
    offload_masters,
    partition_model,
    prepare_dense,
    shards_to_nvme,
    stage3_layout,
    swap_to_nvme,
)
from zengine._assembly._optimizer import (
    ClientOptimizer,
    ClientScheduler,
    ModelParameters,
    OptimizerFactory,
    ParamGroup,
    SchedulerFactory,
    make_loss_scaler,
    make_scheduler,
    optimizer_factory,
    param_groups,
)
from zengine._assembly._refusals import check_allgather_bucket_size

__all__ = [
    "ClientOptimizer",
    "ClientScheduler",
    "HybridGroups",
    "ModelParameters",
    "OptimizerFactory",
    "ParamGroup",
    "SchedulerFactory",
    "check_allgather_bucket_size",
    "hybrid_groups",
    "make_loss_scaler",
    "make_scheduler",
    "offload_masters",
    "optimizer_factory",
    "param_groups",
    "partition_model",
    "prepare_dense",
    "shards_to_nvme",
    "stage3_layout",
    "swap_to_nvme",
]
