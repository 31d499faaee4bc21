"""DeepSpeed's module tree on zstack: ``import deepspeed`` reaches zengine, zpartition, zcomm,
zoffload and zpipe, so Transformers, Accelerate, PEFT and DeepSpeed-style scripts run unchanged.

Every name here is one of zstack's objects or a thin adapter over one. DeepSpeed features zstack
does not have (tensor, sequence and expert parallelism) are importable and raise
`UnsupportedFeatureError` at the call, naming the feature and the alternative.
"""

from deepspeed import (
    accelerator,
    checkpoint,
    checkpointing,
    comm,
    git_version_info,
    launcher,
    moe,
    ops,
    pipe,
    runtime,
    utils,
    zero,
)
from deepspeed.__about__ import __version__
from deepspeed._refused import TENSOR_PARALLEL, UnsupportedFeatureError, refused
from deepspeed.comm import init_distributed  # [Note: Accelerate's world on CPU]
from deepspeed.git_version_info import git_branch as __git_branch__
from deepspeed.git_version_info import git_hash as __git_hash__
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from zengine import (
    DeepSpeedConfigError,
    add_config_arguments,
    initialize,
)

# DeepSpeed's version parts, which some scripts read instead of parsing __version__
__version_major__, __version_minor__, __version_patch__ = (
    int(part) for part in __version__.split("+")[0].split(".")
)

tp_model_init = refused("deepspeed.tp_model_init", *TENSOR_PARALLEL)
init_inference = refused(
    "deepspeed.init_inference",
    "DeepSpeed-Inference (kernel injection, tensor-parallel inference)",
    "Generate with the trained engine under deepspeed.zero.unwrap_model_for_generation, or "
    "save the model (engine.save_16bit_model) and serve it with an inference engine.",
)

__all__ = [
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "PipelineEngine",
    "UnsupportedFeatureError",
    "__git_branch__",
    "__git_hash__",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpoint",
    "checkpointing",
    "comm",
    "git_version_info",
    "init_distributed",
    "init_inference",
    "initialize",
    "launcher",
    "moe",
    "ops",
    "pipe",
    "runtime",
    "tp_model_init",
    "utils",
    "zero",
]
