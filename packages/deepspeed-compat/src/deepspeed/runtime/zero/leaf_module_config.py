"""``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module`` section
and its defaults (Hugging Face's sparse MoE blocks), zengine's."""

from zengine.config import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
    DEFAULT_LEAF_MODULE_NAMES,
)
from zengine.config import LeafModuleConfig as DeepSpeedZeroLeafModuleConfig

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]
