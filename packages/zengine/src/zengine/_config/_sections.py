"""The sections of a DeepSpeed config as frozen pydantic models, with DeepSpeed's keys and defaults.

Every model forbids unknown keys and validates strictly (``"true"`` is not ``true``), except that
sizes counted in elements may be written as whole floats (``5e8``, as DeepSpeed's examples do)
and switches as ``0`` and ``1`` (as DeepSpeed's own tests write them).
`zengine._config._engine_config` puts them together and turns pydantic's errors into readable lines.
"""

from __future__ import annotations

import difflib
import enum
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from zengine._config._errors import config_error, show

__all__ = [
    "AioConfig",
    "BF16Config",
    "CheckpointConfig",
    "DataTypesConfig",
    "FP16Config",
    "Flag",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "Section",
    "TorchAutocastConfig",
    "ZeroConfig",
    "as_switch",
]

OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "Lion")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest", "OneCycle")
# DeepSpeed's Adam options, which torch's optimizers do not take: the engine reads, then drops them.
_DEEPSPEED_OPTIMIZER_OPTIONS = frozenset({"torch_adam", "adam_w_mode"})

OffloadDevice = Literal["none", "cpu", "nvme"]
# DeepSpeed's other spellings: "bfp16" is communication_data_type's, the rest its DtypeEnum's
_DTYPE_ALIASES = {
    "bfp16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
}


def dtype_name(value: object) -> object:
    """A dtype as the config writes it ('fp32', 'fp16', 'bf16'), from any of DeepSpeed's
    spellings (any case); other values as they are, for the type check to report."""
    if isinstance(value, str):
        lowered = value.lower()
        known = lowered in ("fp32", "fp16", "bf16")
        return _DTYPE_ALIASES.get(lowered, lowered if known else value)
    return value


DataType = Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(dtype_name)]


def _whole_number(value: object) -> object:
    # JSON configs write sizes as 5e8, which json parses as a float.
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise config_error(f"expected a whole number, got {show(value)}")
    return value


Size = Annotated[int, BeforeValidator(_whole_number), Field(ge=0)]
"""A count of elements or bytes: a non-negative integer, or a whole float such as ``5e8``."""


def as_switch(value: object) -> object:
    """0 and 1 as false and true; anything else as it is, for the type check to report.
    DeepSpeed reads switches by truthiness, and configs write 0 and 1 for them
    ("zero_allow_untested_optimizer": 1 in its own tests); other numbers stay errors."""
    if type(value) is int and value in (0, 1):
        return bool(value)
    return value


Flag = Annotated[bool, BeforeValidator(as_switch)]
"""A switch: ``true`` or ``false``, or ``1`` or ``0``."""


def _choose(value: object, choices: Sequence[str], what: str) -> object:
    """The canonical spelling of ``value`` among ``choices``, matched case-insensitively."""
    if isinstance(value, enum.Enum):
        value = value.value
    if not isinstance(value, str):
        return value  # the Literal check reports the wrong type
    by_lower = {choice.lower(): choice for choice in choices}
    if value.lower() in by_lower:
        return by_lower[value.lower()]
    close = difflib.get_close_matches(value.lower(), list(by_lower), n=1)
    hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
    raise config_error(f"unknown {what} {show(value)}{hint} (supported: {', '.join(choices)})")


def _check_shard_size(size: int | str) -> int | str:
    if size == "node" or (isinstance(size, int) and (size == -1 or size >= 1)):
        return size
    raise config_error(f'must be -1 (off), a number of ranks, or "node", got {size!r}')


def _check_stage(stage: int) -> int:
    if not 0 <= stage <= 3:
        raise config_error(f"must be 0, 1, 2 or 3, got {stage!r}")
    return stage


# The base of every section (and of zengine.checkpointing's): unknown keys refused, values strict,
# frozen, and read by DeepSpeed's key as a dict is.
class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    # DeepSpeed's ``engine.config`` is the config dict, and Transformers and TRL read it as one
    # (``engine.config.get("zero_optimization", {}).get("stage")``): a section answers the
    # same reads by DeepSpeed's key, with the validated value (defaults filled in).

    def get(self, key: str, default: Any = None) -> Any:
        """The value of DeepSpeed's `key` here (`default` when it has none), as ``dict.get``."""
        name = self._field_of(key)
        value = None if name is None else getattr(self, name)
        return default if value is None else value

    def __getitem__(self, key: str) -> Any:
        if self._field_of(key) is None:
            raise KeyError(key)
        return self.get(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    @classmethod
    def _field_of(cls, key: str) -> str | None:
        if key in cls.model_fields:
            return key
        for name, field in cls.model_fields.items():
            aliases = field.validation_alias
            if isinstance(aliases, AliasChoices) and key in aliases.choices:
                return name
            if field.alias == key:
                return name
        return None


class OptimizerConfig(Section):
    """``optimizer``: which torch optimizer the engine builds, and its keyword arguments."""

    type: Literal["Adam", "AdamW", "SGD", "Adagrad", "Lion"]
    """The optimizer, spelled canonically; DeepSpeed's spelling is matched case-insensitively."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the torch optimizer (``lr``, ``betas``, ``weight_decay``, ...), as
    given: DeepSpeed's ``torch_adam`` and ``adam_w_mode`` (bools) are kept for the engine to
    read and must not reach torch."""

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: object) -> object:
        if isinstance(value, str) and value.lower() == "muon":
            # DeepSpeed's Muon orthogonalizes each weight matrix (Newton-Schulz): it needs the
            # parameters' shapes, and the engine steps flat partitions of them
            raise config_error(
                "'Muon' updates each parameter as a matrix, but zengine steps flat partitions "
                "of the parameters (one tensor per group), which have no matrix shape; use an "
                f"elementwise optimizer ({', '.join(OPTIMIZERS)})"
            )
        return _choose(value, OPTIMIZERS, "optimizer")

    @field_validator("params")
    @classmethod
    def _deepspeed_options_are_bools(cls, params: dict[str, Any]) -> dict[str, Any]:
        params = dict(params)  # the caller's dict stays as written
        for key in sorted(_DEEPSPEED_OPTIMIZER_OPTIONS & params.keys()):
            params[key] = as_switch(params[key])
            if not isinstance(params[key], bool):
                raise config_error(f"expected true or false, got {show(params[key])}", key=key)
        return params


class SchedulerConfig(Section):
    """``scheduler``: one of DeepSpeed's learning-rate schedules and its arguments."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest", "OneCycle"]
    """The schedule, spelled canonically (matched case-insensitively)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the schedule (``warmup_num_steps``, ``warmup_max_lr``, ...)."""

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: object) -> object:
        return _choose(value, SCHEDULERS, "scheduler")


class FP16Config(Section):
    """``fp16``: float16 mixed precision with a static or dynamic loss scale."""

    enabled: Flag = False
    auto_cast: Flag = False
    """Cast the floating-point tensors among the forward's inputs to float16 (the first
    stage's, in a pipeline)."""
    loss_scale: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """A static loss scale; 0 means dynamic loss scaling."""
    initial_scale_power: int = Field(default=16, ge=0)
    """A dynamic scale starts at ``2 ** initial_scale_power``."""
    loss_scale_window: int = Field(default=1000, ge=1)
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: int = Field(default=2, ge=1)
    """Overflows tolerated before the dynamic scale halves."""
    consecutive_hysteresis: Flag = False
    """Refill the hysteresis after every step without overflow."""
    min_loss_scale: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    """The dynamic scale never drops below this."""

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale adapts (``loss_scale`` is 0)."""
        return self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        """The first loss scale of dynamic scaling: ``2 ** initial_scale_power``."""
        return float(2**self.initial_scale_power)


class DataTypesConfig(Section):
    """``data_types``: the dtypes of training state that the precision sections do not set."""

    grad_accum_dtype: DataType | None = None
    """The dtype gradients accumulate in over micro-batches: at stage 3 the gradient
    partitions', at stages 0 and 1 (and in a pipeline) fp32 or the compute dtype, at stage 2
    fp32 always (its partitions); None: DeepSpeed's default, fp32 for bf16 at stage 0 (its
    BF16_Optimizer), else the compute dtype."""


class BF16Config(Section):
    """``bf16`` (DeepSpeed's older name: ``bfloat16``): bfloat16 mixed precision."""

    enabled: Flag = False
    check_grad_overflow: Flag = True
    """DeepSpeed's switch for skipping a step whose gradients hold an inf or NaN; zengine
    checks them always (``nonfinite_gradients`` says what then), so ``false`` warns."""


class TorchAutocastConfig(Section):
    """``torch_autocast``: the engine runs the model's forward under ``torch.autocast``, with
    the parameters, masters and optimizer state in the model's own dtype (fp32): PyTorch's
    native mixed precision, where ``fp16``/``bf16`` cast the model itself."""

    enabled: Flag = False
    dtype: Annotated[Literal["fp16", "bf16"], BeforeValidator(dtype_name)] | None = None
    """What autocast computes in: ``bf16`` or ``fp16`` (fp16 adds dynamic loss scaling, as
    torch's GradScaler); None: torch's default for the device (bf16 on CPU, fp16 on CUDA)."""
    lower_precision_safe_modules: list[str] | None = None
    """Qualified class names (``torch.nn.Linear``) of the modules whose parameters' gradients
    may be reduced in ``dtype`` rather than in their own (each parameter gets ``comm_dtype``);
    an exact class match, as DeepSpeed's. None: Linear and Conv1d/2d/3d."""


class _OffloadConfig(Section):
    device: OffloadDevice = "none"
    """Where to offload: ``none``, ``cpu`` or ``nvme``."""
    nvme_path: Path | None = Field(default=None, strict=False)
    """The folder for NVMe offload files; required when ``device`` is ``nvme``."""
    pin_memory: Flag = False
    """Offload to page-locked host memory."""

    @field_validator("device", mode="before")
    @classmethod
    def _device_value(cls, value: object) -> object:
        # zoffload.OffloadDeviceEnum (a str enum) is accepted as its value.
        return value.value if isinstance(value, enum.Enum) else value

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadConfig:
        if self.device == "nvme" and self.nvme_path is None:
            raise config_error("required when device is 'nvme'", key="nvme_path")
        return self


class OffloadParamConfig(_OffloadConfig):
    """``zero_optimization.offload_param``: where ZeRO-3 keeps partitioned parameters."""

    buffer_count: int = Field(default=5, ge=0)
    """Accepted for DeepSpeed compatibility (DeepSpeed's NVMe swap buffers): zoffload sizes
    its buffers to what it moves."""
    buffer_size: Size = 100_000_000
    """Accepted for DeepSpeed compatibility, as ``buffer_count``."""
    max_in_cpu: Size = 1_000_000_000
    """Accepted for DeepSpeed compatibility: with ``nvme`` every released shard goes to its
    file."""


class OffloadOptimizerConfig(_OffloadConfig):
    """``zero_optimization.offload_optimizer``: where the optimizer state and step live."""

    buffer_count: int = Field(default=4, ge=0)
    """Accepted for DeepSpeed compatibility (DeepSpeed's NVMe swap buffers): zoffload sizes
    its buffers to what it moves."""
    fast_init: Flag = False
    """Accepted for DeepSpeed compatibility (no effect)."""
    pipeline_read: Flag = False
    """Accepted for DeepSpeed compatibility: the next tile is always read during the step on
    this one (and the first during the backward before it)."""
    pipeline_write: Flag = False
    """Accepted for DeepSpeed compatibility: the previous tile is always written during the
    step on this one."""


class AioConfig(Section):
    """``aio``: how NVMe offload reads and writes (DeepSpeed's libaio settings).

    zoffload keeps ``queue_depth x thread_count`` requests of ``block_size`` bytes in flight,
    each on a thread of its own (blocking ``pread``/``pwrite`` with O_DIRECT, not libaio), the
    block rounded up to 4 KiB. ``single_submit`` and ``overlap_events`` tune libaio's batching
    and mean nothing there: they are accepted and have no effect. Without this section zoffload
    uses its own defaults (4 requests of 8 MiB).
    """

    block_size: int = Field(default=1_048_576, ge=1)
    """Bytes per request."""
    queue_depth: int = Field(default=8, ge=1)
    """Requests in flight per thread."""
    thread_count: int = Field(
        default=1, ge=1, validation_alias=AliasChoices("thread_count", "intra_op_parallelism")
    )
    """I/O threads (DeepSpeed's newer name: ``intra_op_parallelism``)."""
    single_submit: Flag = False
    """libaio: submit requests one at a time (no effect here)."""
    overlap_events: Flag = True
    """libaio: overlap submitting and completing requests (no effect here)."""
    use_gds: Flag = False
    """GPUDirect Storage: not available in zoffload; a warning says it is not used."""

    @property
    def requests_in_flight(self) -> int:
        return self.queue_depth * self.thread_count

    @property
    def chunk_bytes(self) -> int:
        """``block_size`` rounded up to O_DIRECT's 4 KiB."""
        return -(-self.block_size // 4096) * 4096


def _none_is_default(value: object) -> object:
    # DeepSpeed writes "offload_param": null for no offload.
    return {} if value is None else value


def _stage3(default: Any, *names: str) -> Any:
    """A ``stage3_`` field that also takes `names` (each spelling of DeepSpeed's)."""
    return Field(default=default, validation_alias=AliasChoices(f"stage3_{names[0]}", *names))


DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
"""DeepSpeed's default ZeRO-3 leaf modules: Hugging Face's sparse MoE blocks, whose experts a
token may or may not reach on each rank (hooked per expert, ranks would gather different ones)."""
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


def _one_or_many(value: object) -> object:
    # DeepSpeed takes one string for a list of one
    return [value] if isinstance(value, str) else value


def _deduplicated(values: list[str]) -> list[str]:
    return list(dict.fromkeys(values))


_Strings = Annotated[list[str], BeforeValidator(_one_or_many), AfterValidator(_deduplicated)]


class LeafModuleConfig(Section):
    """``zero_optimization.leaf_module``: modules made ZeRO-3 leaves (gathered whole, hooked
    once, as ``set_z3_leaf_modules``) when the engine partitions the model: by class (a name or
    a fully qualified name), by name in ``named_modules()``, or by a suffix of that name."""

    classes: _Strings = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: _Strings = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: _Strings = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))


class ZeroConfig(Section):
    """``zero_optimization``: the ZeRO stage and its buckets, thresholds and offload.

    Sizes count elements. Keys marked as accepted for DeepSpeed compatibility are
    validated and kept, but zstack does not act on them.
    """

    stage: Annotated[int, AfterValidator(_check_stage)] = 0
    """0: plain data parallel; 1: optimizer state, 2: and gradients, 3: and parameters."""
    overlap_comm: Flag = False
    """Overlap gradient reduction with backward; defaults to true for stage 3 only."""
    contiguous_gradients: Flag = True
    reduce_scatter: Flag = True
    """Accepted for DeepSpeed compatibility: stages 2 and 3 always reduce-scatter."""
    reduce_bucket_size: Size = 500_000_000
    allgather_bucket_size: Size = 500_000_000
    """Accepted for DeepSpeed compatibility (stages 1 and 2 gather the updated partitions in
    one collective per group)."""
    allgather_partitions: Flag = True
    """Accepted for DeepSpeed compatibility."""
    round_robin_gradients: Flag = False
    """Accepted for DeepSpeed compatibility."""
    ignore_unused_parameters: Flag = True
    """False: a step whose accumulation left a trainable parameter without a gradient (on any
    rank) raises, naming it, at every stage (DeepSpeed checks at stages 1-2 with CPU offload);
    a pipeline engine does not check."""
    load_from_fp32_weights: Flag = True
    """Accepted for DeepSpeed compatibility."""
    elastic_checkpoint: Flag = False
    """Accepted for DeepSpeed compatibility, which deprecates it: zstack's checkpoints load at
    any world size and stage whatever it says; true is said so, in a warning."""
    mics_shard_size: Annotated[int | Literal["node"], AfterValidator(_check_shard_size)] = -1
    """Stage 3 hybrid sharding (DeepSpeed's MiCS, FSDP2's HSDP): parameters, gradients and
    optimizer state are sharded within groups of this many consecutive ranks and replicated
    across the groups; gradients cross the groups once per optimizer step. ``"node"`` (zstack's
    value): the ranks of one node. -1: shard across every rank."""
    zero_hpz_partition_size: Annotated[int, Field(ge=1)] = 1
    """Stage 3, ZeRO++'s hpZ (FSDP2's ``reshard_after_forward=<int>``): after a module's
    forward all-gather each rank keeps 1/n of it, so the backward gathers it within n ranks of
    one node instead of across every rank; it must divide a node's ranks. Costs 1/n of each
    released module's parameters from its forward to its backward. 1: off."""
    zero_quantized_weights: Flag = False
    """Stage 3, ZeRO++'s qwZ: the forward's and backward's all-gathers send each module's
    shards as int8 with a float32 scale per block of 2048 elements (about 1/4 of fp32's bytes,
    1/2 of bf16's); every rank computes with the dequantized weights, while the shards, the
    fp32 masters and what checkpoints and ``GatheredParameters`` read stay exact. Modules
    mixing dtypes, and the small persistent parameters, are gathered exactly."""
    zero_quantized_gradients: Flag = False
    """Stage 3, ZeRO++'s qgZ: each gradient bucket is reduce-scattered as int8 with a float32
    scale per block of 2048 elements through an all-to-all (about 1/4 of fp32's bytes),
    hierarchically over several nodes (within the node, then across with 1/L of the bytes),
    and summed in fp32; each rank's contribution is within half a block's scale."""
    zero_quantized_nontrainable_weights: Flag = False
    """Stage 3, ZeRO++'s MixZ++: modules with no trainable parameter (LoRA's frozen base) are
    quantized once, at ``initialize``, and kept as int8 with a float32 scale per block of 2048
    elements: about 1/4 of their fp32 memory (1/2 of bf16's), and every all-gather of them
    sends those codes. The frozen weights become the dequantized values for good, each within
    half a block's scale of what was loaded, and checkpoints save those; which parameters are
    frozen is read at ``initialize``."""
    node_local_accumulation: Flag = False
    """Stage 3 across several nodes (zstack's key): each micro-batch's gradients are
    reduce-scattered within the node only and held, 1/L of the full gradient per rank (nodes
    of L ranks), then across the nodes once, in the backward that ends the accumulation: the
    gradients cross the nodes once per optimizer step, as with ``mics_shard_size``, while
    parameters and optimizer state stay sharded across every rank. Not with
    ``mics_shard_size``, whose shard groups keep the reductions in the node already."""
    module_group_size: Size = 10_000_000
    """Stage 3 (zstack's key): a module (not the model itself, not a ``ModuleList`` or
    ``Sequential``) of plain layers, directly or through modules without parameters of their
    own (a decoder layer's attention and MLP), whose parameters, all of them below it, hold at
    most this many partitioned elements is gathered as one unit, as a leaf module is, when
    several of its modules hold parameters: one all-gather and one set of hooks per block of
    small layers instead of one per layer (FSDP2's ``fully_shard`` per block, chosen by size).
    The memory of a group's parameters is live at once; at most half of
    ``stage3_max_live_parameters``. 0: one unit per module, as DeepSpeed gathers."""
    mics_hierarchical_params_gather: Flag = False
    """DeepSpeed's two-level gather for a shard group that spans nodes: not built; true is
    accepted where every shard group lies within a node (there it changes nothing)."""
    sub_group_size: Size = 1_000_000_000
    """Stage 3: shard elements the optimizer steps at a time (whole modules), so that NVMe
    offload holds a few tiles of masters and state in memory during a step, not all."""
    # DeepSpeed's own field names lack the stage3_ prefix, which is their alias: it takes both
    stage3_prefetch_bucket_size: Size = _stage3(50_000_000, "prefetch_bucket_size")
    stage3_param_persistence_threshold: Size = _stage3(100_000, "param_persistence_threshold")
    stage3_model_persistence_threshold: Size = _stage3(sys.maxsize, "model_persistence_threshold")
    stage3_max_live_parameters: Size = _stage3(1_000_000_000, "max_live_parameters")
    stage3_max_reuse_distance: Size = _stage3(1_000_000_000, "max_reuse_distance")
    stage3_module_granularity_threshold: Size = _stage3(0, "module_granularity_threshold")
    stage3_gather_16bit_weights_on_model_save: Flag = _stage3(
        False,
        "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",  # DeepSpeed's older name
    )
    offload_param: Annotated[OffloadParamConfig, BeforeValidator(_none_is_default)] = Field(
        default_factory=OffloadParamConfig
    )
    offload_optimizer: Annotated[OffloadOptimizerConfig, BeforeValidator(_none_is_default)] = Field(
        default_factory=OffloadOptimizerConfig
    )
    leaf_module: Annotated[LeafModuleConfig, BeforeValidator(_none_is_default)] = Field(
        default_factory=LeafModuleConfig
    )

    # DeepSpeed's DeepSpeedZeroConfig names the stage3_ fields without the prefix (its tests and
    # Accelerate read ``zero_config.gather_16bit_weights_on_model_save``): the same values

    @property
    def prefetch_bucket_size(self) -> int:
        """``stage3_prefetch_bucket_size``, under DeepSpeed's attribute name."""
        return self.stage3_prefetch_bucket_size

    @property
    def param_persistence_threshold(self) -> int:
        """``stage3_param_persistence_threshold``, under DeepSpeed's attribute name."""
        return self.stage3_param_persistence_threshold

    @property
    def model_persistence_threshold(self) -> int:
        """``stage3_model_persistence_threshold``, under DeepSpeed's attribute name."""
        return self.stage3_model_persistence_threshold

    @property
    def max_live_parameters(self) -> int:
        """``stage3_max_live_parameters``, under DeepSpeed's attribute name."""
        return self.stage3_max_live_parameters

    @property
    def max_reuse_distance(self) -> int:
        """``stage3_max_reuse_distance``, under DeepSpeed's attribute name."""
        return self.stage3_max_reuse_distance

    @property
    def module_granularity_threshold(self) -> int:
        """``stage3_module_granularity_threshold``, under DeepSpeed's attribute name."""
        return self.stage3_module_granularity_threshold

    @property
    def gather_16bit_weights_on_model_save(self) -> bool:
        """``stage3_gather_16bit_weights_on_model_save``, under DeepSpeed's attribute name."""
        return self.stage3_gather_16bit_weights_on_model_save

    @field_validator("elastic_checkpoint")
    @classmethod
    def _elastic_is_deprecated(cls, value: bool) -> bool:
        if value:  # DeepSpeed's words, which its test of the key looks for
            logging.getLogger("zengine").warning(
                "zengine: zero_optimization.elastic_checkpoint: elastic checkpointing is "
                "deprecated; zstack's checkpoints load at any world size and ZeRO stage"
            )
        return value

    @model_validator(mode="before")
    @classmethod
    def _overlap_default(cls, data: Any) -> Any:
        # DeepSpeed: overlap_comm unset (or null) means true for stage 3, false otherwise.
        if isinstance(data, dict) and data.get("overlap_comm") is None:
            return {**data, "overlap_comm": data.get("stage") == 3}
        return data


PIPE_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zero_bubble")


class PipelineConfig(Section):
    """``pipeline``: DeepSpeed's pipeline keys, and which zpipe schedule the engine runs.

    Used only when the model is a ``zengine.pipe.PipelineModule``.
    """

    stages: int | Literal["auto"] = "auto"
    """Pipeline stages; ``auto``: the PipelineModule's. A number must equal the module's."""
    partition: str = "best"
    """Accepted for DeepSpeed compatibility; the PipelineModule's ``partition_method`` rules."""
    seed_layers: Flag = False
    """Accepted for DeepSpeed compatibility; the PipelineModule's ``seed_layers`` rules."""
    activation_checkpoint_interval: int = Field(default=0, ge=0)
    """Checkpoint every this many layers; 0 keeps the PipelineModule's own interval."""
    use_reentrant: Flag | None = None
    """DeepSpeed's: false sets the PipelineModule's checkpoint function to
    ``zengine.checkpointing.non_reentrant_checkpoint``; true keeps the module's own (reentrant
    by default), and the first stage's floating-point inputs then require grad. None: true,
    except with ``zero_bubble``, whose split backward reentrant checkpointing cannot run."""
    pipe_partitioned: Flag = True
    """Accepted for DeepSpeed compatibility (tensor slicing of activations)."""
    grad_partitioned: Flag = True
    """Accepted for DeepSpeed compatibility (tensor slicing of gradients)."""
    schedule: Literal["1f1b", "gpipe", "interleaved", "zero_bubble"] = "1f1b"
    """The zpipe schedule of ``train_batch``: 1F1B (DeepSpeed's), GPipe, interleaved 1F1B or
    ZB-H1 (matched case-insensitively)."""
    chunks: int | None = Field(default=None, ge=1)
    """Model chunks per stage (interleaved); None: the PipelineModule's ``chunks``."""
    p2p_timeout: float = Field(default=300.0, gt=0, allow_inf_nan=False)
    """Seconds a stage waits for a message from its neighbour before it raises an error
    naming the stage and the instruction."""

    @field_validator("stages", mode="before")
    @classmethod
    def _positive_stages(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise config_error(f"must be 'auto' or at least 1, got {show(value)}")
        return value

    @field_validator("schedule", mode="before")
    @classmethod
    def _canonical_schedule(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.replace("-", "_")
        return _choose(value, PIPE_SCHEDULES, "pipeline schedule")


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``."""

    pipeline_stage: Flag = False
    """Each pipeline stage writes its own part of the checkpoint."""


class CheckpointConfig(Section):
    """``checkpoint``: how checkpoints are tagged, written and loaded."""

    tag_validation: Literal["IGNORE", "WARN", "FAIL"] = "WARN"
    """What to do when ranks save under different tags (matched case-insensitively)."""
    load_universal: Flag = False
    """Load a universal (topology-independent) checkpoint."""
    use_node_local_storage: Flag = False
    """Each node saves to its own local storage."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Seconds a rank waits for the others to join a checkpoint save or load before it raises
    an error naming the missing ranks (gloo); None: the process group's timeout."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _canonical_mode(cls, value: object) -> object:
        return _choose(value, ("IGNORE", "WARN", "FAIL"), "tag_validation mode")
