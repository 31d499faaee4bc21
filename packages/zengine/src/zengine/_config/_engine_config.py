"""The DeepSpeed config: `load_config` reads and validates it into a frozen `EngineConfig`.

Validation collects every problem before raising, so a config with three mistakes fails once,
with three lines, not three times. The rules that span keys (batch-size arithmetic, fp16
against bf16) are checked on the raw dict, so that they are reported alongside type errors.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import hjson  # type: ignore[import-untyped]
import torch
from pydantic import AliasChoices, Field, ValidationError, field_validator

from zengine._config._batch import resolve_batch
from zengine._config._deepspeed_keys import keys_at, set_aside
from zengine._config._errors import ConfigError, config_error, describe_validation_error, show
from zengine._config._grad_reduction import GradReduction
from zengine._config._hf_edits import expand_dotted, without_auto
from zengine._config._params import param_problems
from zengine._config._sections import (
    AioConfig,
    BF16Config,
    CheckpointConfig,
    DataType,
    DataTypesConfig,
    Flag,
    FP16Config,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    Section,
    TorchAutocastConfig,
    ZeroConfig,
    dtype_name,
)
from zpartition import ZeroParamConfig

__all__ = [
    "ConfigError",
    "ConfigSource",
    "EngineConfig",
    "load_config",
    "read_config",
    "read_section",
]

log = logging.getLogger("zengine")

_Positive = Annotated[int, Field(ge=1)]
_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class _Sections(Section):
    """Every key but the three batch sizes, whose resolved and given forms differ."""

    steps_per_print: int | float = Field(default=10, ge=1)
    """Log progress every this many optimizer steps; ``inf`` never (Accelerate sets it so to
    keep DeepSpeed quiet)."""

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _whole_or_never(cls, value: object) -> object:
        if value == math.inf or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise config_error(f"expected an integer or inf (never), got {show(value)}")

    gradient_clipping: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Clip the global gradient norm to this; 0 turns clipping off."""
    optimizer: OptimizerConfig | None = None
    """The optimizer to build, if the caller passes none."""
    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule to build, if the caller passes none."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(
        default_factory=BF16Config, validation_alias=AliasChoices("bf16", "bfloat16")
    )
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """The pipeline engine's stages and schedule (a ``zengine.pipe.PipelineModule`` model)."""
    aio: AioConfig | None = None
    """How NVMe offload reads and writes (DeepSpeed's defaults when the section is there, even
    empty); None: zoffload's own defaults."""
    wall_clock_breakdown: Flag = False
    """Time forward, backward and step separately."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    communication_data_type: DataType | None = None
    """The dtype gradients are reduced in (``fp32`` sums bf16 or fp16 gradients without
    rounding each partial sum); None: the model's compute dtype."""
    dataloader_drop_last: Flag = False
    """The loader built from ``initialize(training_data=...)`` drops a last, shorter
    micro-batch."""
    zero_allow_untested_optimizer: Flag = False
    """Accepted for DeepSpeed compatibility: zengine runs any torch optimizer at every stage."""
    zero_force_ds_cpu_optimizer: Flag = True
    """With ``offload_optimizer``, refuse an optimizer passed to ``initialize`` unless it is
    ``ops.adam.DeepSpeedCPUAdam`` or ``ops.lion.DeepSpeedCPULion`` (DeepSpeed's rule: another
    optimizer steps the host's masters slowly); false lets any optimizer step there."""
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """What the data-parallel reduction makes of the ranks' gradients: their mean or their sum
    (matched case-insensitively; [Note: gradient reduction])."""
    prescale_gradients: Flag = False
    """Divide the gradients by the data-parallel size before their sum, not after."""
    gradient_predivide_factor: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    """Divide the gradients by this before their sum, and the sum by ranks / factor after."""

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _lower_op(cls, value: object) -> object:
        if not isinstance(value, str):
            return value  # the type check says what is wrong
        if value.lower() not in ("mean", "sum"):
            # DeepSpeed's opening words, which its users' checks match
            raise config_error(
                f"Invalid gradient_allreduce_op {show(value)}: expected 'mean' or 'sum' (any case)"
            )
        return value.lower()

    host_memory_trim: Literal["idle", "step", "off"] = "idle"
    """On CPU, when the engine hands the heap's freed memory back to the system ([Note:
    returning memory on CPU]): once it has sat idle a second after a step or an evaluation
    (a training loop keeps its working memory for the next step), after every step (between
    steps the process holds little more than the model states; every step faults its working
    memory in again, which costs time), or never (glibc's own trimming as it frees, as in a
    process without zengine). Not a DeepSpeed key."""
    nonfinite_gradients: Literal["skip", "raise"] = "skip"
    """With bf16 or fp32, what a step does when a gradient holds an inf or NaN: skip it (the
    masters stay as they were; DeepSpeed's behaviour) or raise an error on every rank. With fp16
    such a step is always skipped and the loss scale lowered."""


class _GivenConfig(_Sections):
    train_batch_size: _Positive | None = None
    train_micro_batch_size_per_gpu: _Positive | None = None
    gradient_accumulation_steps: _Positive | None = None


class EngineConfig(_Sections):
    """A validated DeepSpeed config, with the batch sizes resolved; made by `load_config`.

    ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps *
    world_size`` holds. Sections are models of their own (``config.zero_optimization.stage``).
    """

    train_batch_size: _Positive
    """Samples per optimizer step, over all data-parallel ranks."""
    train_micro_batch_size_per_gpu: _Positive
    """Samples per forward and backward on one rank."""
    gradient_accumulation_steps: _Positive
    """Micro-batches per optimizer step."""

    @property
    def communication_dtype(self) -> torch.dtype | None:
        """``communication_data_type`` as a torch dtype (None when not given)."""
        name = self.communication_data_type
        return None if name is None else _TORCH_DTYPES[name]

    @property
    def gradient_reduction(self) -> GradReduction:
        """``gradient_allreduce_op``, ``prescale_gradients`` and ``gradient_predivide_factor``."""
        return GradReduction(
            average=self.gradient_allreduce_op == "mean",
            prescale=bool(self.prescale_gradients),
            predivide=float(self.gradient_predivide_factor),
        )

    @property
    def gradient_accumulation_dtype(self) -> DataType | None:
        """``data_types.grad_accum_dtype``."""
        return self.data_types.grad_accum_dtype

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage, 0 to 3."""
        return self.zero_optimization.stage

    @property
    def fp16_enabled(self) -> bool:
        """Whether the model computes in float16."""
        return self.fp16.enabled

    @property
    def bf16_enabled(self) -> bool:
        """Whether the model computes in bfloat16."""
        return self.bf16.enabled

    @property
    def dtype(self) -> torch.dtype:
        """The model's compute dtype: float16, bfloat16 or float32."""
        if self.fp16.enabled:
            return torch.float16
        return torch.bfloat16 if self.bf16.enabled else torch.float32

    @property
    def accumulation_dtype(self) -> torch.dtype:
        """What gradients accumulate in over the micro-batches: ``data_types.grad_accum_dtype``,
        or DeepSpeed's default, fp32 for bf16 without ZeRO (its BF16_Optimizer) and the compute
        dtype otherwise."""
        name = self.data_types.grad_accum_dtype
        if name is not None:
            return _TORCH_DTYPES[name]
        return torch.float32 if self.bf16.enabled and self.zero_stage == 0 else self.dtype

    def zero_param_config(self) -> ZeroParamConfig:
        """The ZeRO-3 parameter knobs, from ``zero_optimization``'s ``stage3_*`` keys."""
        zero = self.zero_optimization
        return ZeroParamConfig(
            prefetch_bucket_size=zero.stage3_prefetch_bucket_size,
            param_persistence_threshold=zero.stage3_param_persistence_threshold,
            model_persistence_threshold=zero.stage3_model_persistence_threshold,
            max_live_parameters=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
            reduce_bucket_size=zero.reduce_bucket_size,
            overlap_comm=zero.overlap_comm,
            module_granularity_threshold=zero.stage3_module_granularity_threshold,
            module_group_size=zero.module_group_size,
            reduce_dtype=self.communication_dtype,
            secondary_partition_size=zero.zero_hpz_partition_size,
            node_local_accumulation=zero.node_local_accumulation,
            quantized_weights=zero.zero_quantized_weights,
            quantized_gradients=zero.zero_quantized_gradients,
            quantized_nontrainable_weights=zero.zero_quantized_nontrainable_weights,
        )


ConfigSource = Mapping[str, Any] | str | os.PathLike[str] | None
"""What ``initialize(config=...)`` takes: DeepSpeed's config as a dict, or its JSON file's path
(None: the defaults)."""


def load_config(
    config: ConfigSource, *, world_size: int, with_optimizer: bool = True
) -> EngineConfig:
    """Validate a DeepSpeed config (a dict, or the path of a JSON file; None is ``{}``).

    ``world_size`` is the data-parallel size, which the batch sizes are resolved against:
    of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
    ``gradient_accumulation_steps``, the ones not given are derived as DeepSpeed does.
    Dotted top-level keys (``"zero_optimization.reduce_bucket_size"``) set the nested key;
    with ``with_optimizer=False`` (the config of a model without an optimizer: an inference or
    a reference engine) ``"auto"`` values take the engine's defaults ([Note: dotted keys and
    "auto"]). Raises `ConfigError` listing every problem found.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"load_config(world_size=...): expected a positive int, got {world_size!r}"
        )
    expanded, problems = expand_dotted(read_config(config), _GivenConfig)
    if not with_optimizer:
        expanded = without_auto(expanded)
    aside = set_aside(expanded)  # [Note: DeepSpeed keys without a feature]
    data = aside.data
    given: _GivenConfig | None = None
    try:
        given = _GivenConfig.model_validate(data)
    except ValidationError as error:
        problems += describe_validation_error(error, _GivenConfig, keys_at)
    problems += aside.problems
    problems += _precision_problems(data)
    problems += param_problems(data)
    batch, batch_problems = resolve_batch(data, world_size)
    problems += batch_problems
    if problems or given is None or batch is None:
        raise ConfigError(problems)
    for line in aside.reports:
        log.warning("zengine: config %s", line)
    if not given.bf16.check_grad_overflow:
        log.warning(
            "zengine: config bf16.check_grad_overflow: false: zengine still checks the "
            "gradients for inf and NaN, and skips such a step (nonfinite_gradients: %r)",
            given.nonfinite_gradients,
        )
    sections = {name: getattr(given, name) for name in _Sections.model_fields}
    train, micro, accumulation = batch
    return EngineConfig(
        **sections,
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accumulation,
    )


def read_section(config: ConfigSource, key: str) -> Section:
    """The section `key` of a DeepSpeed config (``"bf16"`` or its alias ``"bfloat16"``,
    ``"zero_optimization"``, ...), validated as `load_config` validates it, and its defaults
    when the config has none; the rest of the config is not read (DeepSpeed's
    ``get_bfloat16_config(param_dict)`` and the like, which need no batch sizes).

    Raises:
        ConfigError: `key` is no section of the config, or the section's problems.
    """
    sections = {
        name: field
        for name, field in _Sections.model_fields.items()
        if isinstance(field.get_default(call_default_factory=True), Section)
    }
    name = _Sections._field_of(key)
    if name is None or name not in sections:
        raise ConfigError([f"{key}: not a section of the config (sections: {', '.join(sections)})"])
    data = read_config(config)
    given = {k: v for k, v in data.items() if _Sections._field_of(str(k).split(".")[0]) == name}
    given, problems = expand_dotted(given, _Sections)  # [Note: dotted keys and "auto"]
    aside = set_aside(given)  # [Note: DeepSpeed keys without a feature]
    problems += aside.problems + param_problems(aside.data)
    try:
        validated = _Sections.model_validate(aside.data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, _Sections, keys_at) + problems) from None
    if problems:
        raise ConfigError(problems)
    section: Section = getattr(validated, name)
    return section


def read_config(config: object) -> dict[Any, Any]:
    """A config as a dict: a mapping as it is, a JSON (or hjson) file read; None is {}."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        return _read_json(Path(config))
    raise ConfigError(
        [f"config: expected a dict or the path of a JSON file, got {type(config).__name__}"]
    )


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # DeepSpeed refuses a key given twice, where json would silently keep the last.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def _read_json(path: Path) -> dict[Any, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: config file not found"]) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError([f"{path}: cannot read the config file: {error}"]) from error
    try:
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError:
            # DeepSpeed reads its config files as HJSON: comments, unquoted keys and values
            data = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except hjson.HjsonDecodeError as error:
        where = f"line {error.lineno} column {error.colno}"
        raise ConfigError([f"{path}: not valid JSON (or HJSON): {error.msg} at {where}"]) from None
    except _DuplicateKeyError as error:
        raise ConfigError([f"{path}: key {error.args[0]!r} is given twice"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a JSON object, got {type(data).__name__}"])
    return data


def _enabled(section: object) -> bool:
    return isinstance(section, Mapping) and section.get("enabled") is True


def _precision_problems(data: Mapping[Any, Any]) -> list[str]:
    bf16 = "bf16" if "bf16" in data else "bfloat16"
    if _enabled(data.get("fp16")) and _enabled(data.get(bf16)):
        return [f"{bf16}.enabled: fp16 and bf16 cannot both be enabled; disable one of them"]
    compute = (
        "bf16" if _enabled(data.get(bf16)) else "fp16" if _enabled(data.get("fp16")) else "fp32"
    )
    types, zero = data.get("data_types"), data.get("zero_optimization")
    accumulate = dtype_name(types.get("grad_accum_dtype")) if isinstance(types, Mapping) else None
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if accumulate in {"fp16", "bf16"} - {compute} and isinstance(stage, int) and stage < 3:
        # said rather than ignored: stages 0-2 accumulate in fp32 or the compute dtype
        return [
            f"data_types.grad_accum_dtype: {accumulate} is neither fp32 nor the compute dtype "
            f"({compute}); ZeRO stages 0-2 accumulate gradients in one of those, another "
            f"dtype works at stage 3 only (the stage is {stage})"
        ]
    return []
