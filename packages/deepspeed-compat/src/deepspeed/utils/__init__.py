"""``deepspeed.utils``: zengine.utils (``safe_get_*``, logging) and zpartition's leaf modules."""

import zcomm
from deepspeed.utils import groups, zero_to_fp32
from zengine.utils import (
    RepeatingLoader,
    log_dist,
    logger,
    print_dist,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    see_memory_usage,
)
from zpartition import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

# DeepSpeed re-exports deepspeed.comm's is_initialized here (ESMFold's check reads it)
is_initialized = zcomm.is_initialized

__all__ = [
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "groups",
    "is_initialized",
    "log_dist",
    "logger",
    "print_dist",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "see_memory_usage",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_to_fp32",
]
