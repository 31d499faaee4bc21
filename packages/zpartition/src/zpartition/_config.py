"""The knobs of ZeRO-3 parameter handling, under DeepSpeed's names without ``stage3_``
(``reduce_bucket_size`` has none in DeepSpeed either)."""

from __future__ import annotations

import dataclasses
import sys

import torch

__all__ = ["ZeroParamConfig"]


@dataclasses.dataclass(frozen=True)
class ZeroParamConfig:
    """How parameters are gathered, kept and prefetched; every size counts elements.

    The defaults are DeepSpeed's, but for `module_group_size`. zengine builds this from
    ``zero_optimization``'s ``stage3_*`` keys.
    """

    prefetch_bucket_size: int = 50_000_000
    """Elements gathered ahead of the module that runs now, once the order is known."""
    param_persistence_threshold: int = 100_000
    """Parameters of at most this many elements stay gathered all the time."""
    model_persistence_threshold: int = sys.maxsize
    """At most this many elements in all persistent parameters together."""
    max_live_parameters: int = 1_000_000_000
    """At most this many elements gathered at once (the running module's always are)."""
    max_reuse_distance: int = 1_000_000_000
    """A parameter used again within this many gathered elements is kept, not released."""
    reduce_bucket_size: int = 500_000_000
    """Gradients of finished modules are reduce-scattered together once this many wait."""
    overlap_comm: bool = True
    """Leave each bucket's reduce-scatter in flight while backward goes on (done at its end)."""
    module_granularity_threshold: int = 0
    """Modules whose parameters per layer are at most this become leaves (0: none)."""
    module_group_size: int = 10_000_000
    """A module (not the root, not a container) whose children are plain layers, or modules
    without parameters of their own over plain layers (a transformer block's attention and
    MLP), and whose subtree holds at most this many partitioned elements in more than one
    module, is gathered as one unit, as a leaf is: hooks on it alone, its small modules'
    fetches made one (FSDP2's ``fully_shard`` per block). Capped at half of
    ``max_live_parameters``. 0: a unit per module, as DeepSpeed ([Note: module groups])."""
    reduce_dtype: torch.dtype | None = None
    """The dtype gradients are reduce-scattered in (FSDP2's ``reduce_dtype``, DeepSpeed's
    ``communication_data_type``): float32 sums bf16 gradients without rounding each partial
    sum; the reduced shard gradient comes back in the parameter's dtype (or to the gradient
    sink as reduced). None: each parameter's own dtype. A parameter with a ``comm_dtype``
    attribute (DeepSpeed's, which zengine's ``torch_autocast`` sets) is reduced in that."""
    reduce_scale: tuple[float, float] | None = None
    """``(before, after)``: gradients are multiplied by ``before`` in the reduction's dtype,
    reduce-scattered as a sum, and the result multiplied by ``after`` (DeepSpeed's
    ``gradient_allreduce_op``, ``prescale_gradients`` and ``gradient_predivide_factor``, which
    zengine turns into these factors). None: the average (zengine's choice for one rank too,
    where the factors multiply to one)."""
    persistent_grad_buckets: bool = False
    """Keep each dtype's gradient bucket between backward passes (DeepSpeed's contiguous
    gradient buffer) instead of allocating it per pass: worth it on accelerators, whose caching
    allocator keeps the memory anyway; on CPU the freed bucket goes back to the system."""
    secondary_partition_size: int = 1
    """ZeRO++'s hpZ (DeepSpeed's ``zero_hpz_partition_size``, FSDP2's
    ``reshard_after_forward=<int>``): after a unit's forward all-gather each rank keeps 1/S of
    the unit, so that the backward gathers it within a group of S ranks inside a node instead
    of across the world ([Note: secondary partition]). S must divide a node's ranks and the
    number of ranks partitioned across (`ZeroParamError` at `partition` otherwise); 1: off."""
    node_local_accumulation: bool = False
    """Reduce-scatter each micro-batch's gradients within the node only and hold them (1/L
    of the full gradient per rank, nodes of L ranks), then across the nodes once, in the
    backward that ends the accumulation (``Partitioned.set_requires_all_reduce(True)``): the
    gradients cross the nodes once per optimizer step ([Note: node-local accumulation]). For
    ZeRO-3 across the world over several nodes; nothing changes on one node; hybrid
    sharding's shard groups already keep the reduce-scatters in the node (`partition` refuses
    both at once)."""
    quantized_weights: bool = False
    """ZeRO++'s qwZ (DeepSpeed's ``zero_quantized_weights``): the all-gathers of the forward
    and backward passes (fetches and prefetches) send each unit's shard as int8 codes with one
    float32 scale per block of ``quantized_weights_block_size`` elements, about 1/4 of fp32's
    bytes (1/2 of bf16's), and every rank computes with the dequantized weights, each element
    within half its block's scale of the exact one ([Note: quantized weights]). Costs: that
    error in the weights the passes compute with (the shards, the optimizer's masters, stay
    exact, as do `GatheredParameters` and ``param.all_gather()``), a quantization and a
    dequantization per gather, and a re-gather before an exact reader reads a unit a pass
    gathered. Units mixing dtypes and persistent units are gathered exactly."""
    quantized_weights_block_size: int = 2048
    """Elements per quantization block (one float32 scale each) with ``quantized_weights``, at
    least 1: smaller blocks follow the weights' range more closely (a smaller error) and send
    more scales (4 bytes per block); a gather (or a reduce-scatter's chunk) of fewer elements
    than a block goes as one block of its own size."""
    quantized_gradients: bool = False
    """ZeRO++'s qgZ (DeepSpeed's ``zero_quantized_gradients``): each gradient bucket is
    reduce-scattered as int8 codes with one float32 scale per block of
    ``quantized_weights_block_size`` elements through one all-to-all
    (`zcomm.reduce_scatter_quantized`), hierarchically over the nodes when the model is
    partitioned across a world of several (within the node first, then across with 1/L of the
    bytes), and summed in float32. Costs: each rank's contribution is off by up to half its
    block's scale (the hierarchical second stage adds as much again), a quantization and a
    dequantization per bucket. The masters and what the optimizer accumulates stay float."""
    quantized_nontrainable_weights: bool = False
    """ZeRO++'s MixZ++ (DeepSpeed's ``zero_quantized_nontrainable_weights``): the units with
    no trainable parameter (LoRA's frozen base) are quantized once, as the model is
    partitioned, and kept as int8 codes with one float32 scale per block of
    ``quantized_weights_block_size`` elements: about 1/4 of an fp32 shard's memory (1/2 of a
    bf16 one's), and every gather of them sends the codes ([Note: quantized frozen weights]).
    Costs: the frozen weights become their dequantized values, each within half its block's
    scale of what they were, for good (a checkpoint saves those); reading or writing their
    ``ds_tensor`` needs ``Partitioned.fetch_shards`` first. Which parameters are frozen is
    read when the model is partitioned."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "reduce_scale":
                if value is not None and not (
                    isinstance(value, tuple)
                    and len(value) == 2
                    and all(isinstance(v, (int, float)) and v > 0 for v in value)
                ):
                    raise TypeError(
                        "ZeroParamConfig.reduce_scale must be None or two positive numbers "
                        f"(before, after), got {value!r}"
                    )
                continue
            if field.name == "reduce_dtype":
                if value is not None and not (
                    isinstance(value, torch.dtype) and value.is_floating_point
                ):
                    raise TypeError(
                        f"ZeroParamConfig.reduce_dtype must be a floating torch.dtype or None, "
                        f"got {value!r}"
                    )
                continue
            if field.type == "bool":
                if not isinstance(value, bool):
                    raise TypeError(f"ZeroParamConfig.{field.name} must be a bool, got {value!r}")
                continue
            ranks = field.name == "secondary_partition_size"  # the only count of ranks
            positive = ranks or field.name == "quantized_weights_block_size"
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, field.name, int(value))  # JSON configs write 1e5
            elif not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(
                    f"ZeroParamConfig.{field.name} must be an integer number of "
                    f"{'ranks' if ranks else 'elements'}, got {value!r}"
                )
            if getattr(self, field.name) < (1 if positive else 0):
                least = "1 (1: off)" if ranks else "1" if positive else "0"
                raise ValueError(f"ZeroParamConfig.{field.name} must be >= {least}, got {value}")
