"""The config: DeepSpeed's keys read, validated and frozen into an `EngineConfig`.

Owns the section models with DeepSpeed's keys and defaults (_sections.py), the keys of DeepSpeed
features zengine does not have and what a config holding one gets (_deepspeed_keys.py), the
errors that name a key's full path (_errors.py), the reduction options the config sets
(_grad_reduction.py), the batch sizes (_batch.py), the whole config, `load_config` and
`read_section` (_engine_config.py), and DeepSpeed's command-line flags, the config file's and
the LR schedule's (_args.py). It reads and checks; what a section does to the model, the
optimizer or the offload lives with them.
"""

from zengine._config._args import (
    SCHEDULE_FLAGS,
    add_config_arguments,
    add_tuning_arguments,
    scheduler_from_args,
)
from zengine._config._batch import resolve_batch_sizes
from zengine._config._engine_config import (
    ConfigSource,
    EngineConfig,
    load_config,
    read_config,
    read_section,
)
from zengine._config._errors import ConfigError, describe_validation_error
from zengine._config._grad_reduction import GradReduction
from zengine._config._sections import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
    DEFAULT_LEAF_MODULE_NAMES,
    AioConfig,
    BF16Config,
    Flag,
    FP16Config,
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    PipelineConfig,
    Section,
    ZeroConfig,
)

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "SCHEDULE_FLAGS",
    "AioConfig",
    "BF16Config",
    "ConfigError",
    "ConfigSource",
    "EngineConfig",
    "FP16Config",
    "Flag",
    "GradReduction",
    "LeafModuleConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "PipelineConfig",
    "Section",
    "ZeroConfig",
    "add_config_arguments",
    "add_tuning_arguments",
    "describe_validation_error",
    "load_config",
    "read_config",
    "read_section",
    "resolve_batch_sizes",
    "scheduler_from_args",
]
