"""ZeRO-3 parameters for PyTorch: partitioning, hooks, prefetching, Init and GatheredParameters.

`partition` hooks a built model (FSDP2's ``fully_shard`` in spirit, DeepSpeed's semantics);
`Init` partitions while the model is built; `GatheredParameters` gathers inside a block. The
parameters keep DeepSpeed's ``ds_*`` attributes, so code written for DeepSpeed ZeRO-3 works.
"""

from zpartition.__about__ import __version__
from zpartition._config import ZeroParamConfig
from zpartition._discarded import DiscardedChangeError
from zpartition._errors import ZeroParamError
from zpartition._external import register_external_parameter, unregister_external_parameter
from zpartition._gathered import GatheredParameters
from zpartition._hybrid import hybrid_groups
from zpartition._init import Init
from zpartition._leaf import (
    get_z3_leaf_modules,
    leaf_modules_by_granularity,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from zpartition._param import ZeroParameter
from zpartition._partitioned import Partitioned, partition
from zpartition._reduce import GradientSink
from zpartition._status import ZeroParamStatus
from zpartition._store import ShardStore
from zpartition._tensors import apply_to_tensors_only, is_zero_param
from zpartition._unit import Unit

__all__ = [
    "DiscardedChangeError",
    "GatheredParameters",
    "GradientSink",
    "Init",
    "Partitioned",
    "ShardStore",
    "Unit",
    "ZeroParamConfig",
    "ZeroParamError",
    "ZeroParamStatus",
    "ZeroParameter",
    "__version__",
    "apply_to_tensors_only",
    "get_z3_leaf_modules",
    "hybrid_groups",
    "is_zero_param",
    "leaf_modules_by_granularity",
    "partition",
    "register_external_parameter",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unregister_external_parameter",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]
