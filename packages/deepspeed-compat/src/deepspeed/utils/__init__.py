"""``deepspeed.utils``: zengine.utils (``safe_get_*``, logging) and zpartition's leaf modules."""

import importlib
from types import ModuleType

import zcomm
from deepspeed.utils import groups
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


def __getattr__(name: str) -> ModuleType:
    # zero_to_fp32 on first use, as DeepSpeed's package leaves it: imported here, `python -m
    # deepspeed.utils.zero_to_fp32` would find it loaded already and warn that it runs twice
    if name == "zero_to_fp32":
        return importlib.import_module("deepspeed.utils.zero_to_fp32")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "zero_to_fp32",  # noqa: F405 - given by __getattr__, on first use
]
