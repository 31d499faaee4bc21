"""The config's validated sections, for code that builds or reads one section on its own
(DeepSpeed's ``DeepSpeedZeroConfig(**zero_section)`` is `ZeroConfig`). Each takes DeepSpeed's
keys and defaults, and names a bad key or value as `EngineConfig` does."""

from zengine._config import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
    DEFAULT_LEAF_MODULE_NAMES,
    ConfigError,
    EngineConfig,
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    load_config,
)

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "ConfigError",
    "EngineConfig",
    "LeafModuleConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroConfig",
    "load_config",
]
