"""The config's validated sections, for code that builds or reads one section on its own
(DeepSpeed's ``DeepSpeedZeroConfig(**zero_section)`` is `ZeroConfig`, its
``get_bfloat16_config(config)`` is ``read_section(config, "bf16")``). Each takes DeepSpeed's
keys and defaults, and names a bad key or value as `EngineConfig` does. Also a config read
as a dict (`read_config`: JSON or HJSON files, DeepSpeed's), the batch sizes'
arithmetic (`resolve_batch_sizes`) and DeepSpeed's learning-rate flags (`add_tuning_arguments`,
read back into a ``"scheduler"`` section by `scheduler_from_args`)."""

from zengine._config import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
    DEFAULT_LEAF_MODULE_NAMES,
    SCHEDULE_FLAGS,
    BF16Config,
    ConfigError,
    EngineConfig,
    FP16Config,
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    add_tuning_arguments,
    load_config,
    read_config,
    read_section,
    resolve_batch_sizes,
    scheduler_from_args,
)

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "SCHEDULE_FLAGS",
    "BF16Config",
    "ConfigError",
    "EngineConfig",
    "FP16Config",
    "LeafModuleConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZeroConfig",
    "add_tuning_arguments",
    "load_config",
    "read_config",
    "read_section",
    "resolve_batch_sizes",
    "scheduler_from_args",
]
