"""``deepspeed.utils``: zengine.utils (``safe_get_*``, logging) and zpartition's leaf modules."""

import zcomm
from deepspeed.utils import groups, zero_to_fp32
from zengine.utils import *  # noqa: F403 - DeepSpeed's deepspeed.utils names, zengine's
from zengine.utils import __all__ as _utils_names
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
    *_utils_names,
    "get_z3_leaf_modules",
    "groups",
    "is_initialized",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_to_fp32",
]
