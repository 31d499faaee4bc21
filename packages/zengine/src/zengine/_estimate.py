"""How much memory ZeRO-3 (and ZeRO-2) model states (params, gradients, optimizer states) need
per GPU and CPU.

DeepSpeed's estimators (``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs*``
and ``stage_1_and_2.estimate_zero2_model_states_mem_needs*``) with the same names, formulas and
printed tables. For ZeRO-3 it counts mixed-precision Adam: 2 bytes of
fp16/bf16 param and 2 of gradient, 12 of fp32 master weights and moments, plus 2 more for
the fp16 gradient kept when offloaded, i.e. 18 bytes per parameter spread over the GPUs or
held on the CPUs, and 4 bytes per parameter of the largest layer, which has to be gathered
whole on each GPU. Activations and temporary buffers are not included;
``additional_buffer_factor`` pads the CPU figure for pinned-memory and copy buffers.

`estimate_memory` gives the table's rows as `MemoryEstimate` values for code to use.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

import zcomm

__all__ = [
    "MemoryEstimate",
    "estimate_memory",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
]

_GB = 2**30
# The (offload_optimizer, offload_param) choices in DeepSpeed's table order; parameters can
# only be offloaded together with the optimizer.
_OFFLOAD_CHOICES = ((True, True), (True, False), (False, False))


@dataclass(frozen=True)
class MemoryEstimate:
    """One row of the estimate: a ZeRO-3 configuration and the model-state bytes it needs."""

    offload_param: bool
    """``zero_optimization.offload_param.device == "cpu"``."""
    offload_optimizer: bool
    """``zero_optimization.offload_optimizer.device == "cpu"``."""
    zero_init: bool
    """The model is built under ``zero.Init``, so no rank ever holds it whole on the CPU."""
    per_gpu_bytes: int
    per_cpu_bytes: int
    """Per node (host), for all the GPUs of the node together."""
    secondary_bytes: int = 0
    """Of `per_gpu_bytes`, hpZ's secondary shards (``zero_hpz_partition_size``): 1/n of every
    released module's 16-bit parameters, all of them held at the end of a forward."""
    accumulation_bytes: int = 0
    """Of `per_gpu_bytes`, node-local accumulation's held gradients
    (``node_local_accumulation``): one shard per node of every 16-bit gradient, 1/n of the
    full gradient with n GPUs per node, between an accumulation's micro-batches."""

    def options(self) -> str:
        """The options column of DeepSpeed's table."""
        param = "cpu " if self.offload_param else "none"
        optimizer = "cpu " if self.offload_optimizer else "none"
        zero_init = int(self.zero_init)
        return f"offload_param={param}, offload_optimizer={optimizer}, zero_init={zero_init}"


def _check_count(caller: str, name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{caller}({name}=...): expected an int >= {low}, got {value!r}")


def _check_args(
    caller: str,
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int,
    num_nodes: int,
    additional_buffer_factor: float,
) -> None:
    _check_count(caller, "total_params", total_params, 0)
    _check_count(caller, "largest_layer_params", largest_layer_params, 0)
    _check_count(caller, "num_gpus_per_node", num_gpus_per_node, 1)
    _check_count(caller, "num_nodes", num_nodes, 1)
    if (
        isinstance(additional_buffer_factor, bool)
        or not isinstance(additional_buffer_factor, (int, float))
        or not additional_buffer_factor > 0
    ):
        raise ValueError(
            f"{caller}(additional_buffer_factor=...): expected a number > 0, "
            f"got {additional_buffer_factor!r}"
        )


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """The model-state memory of one ZeRO-3 configuration, in bytes.

    Returns ``(per_cpu_bytes, per_gpu_bytes, largest_layer_memory)``: CPU first, in
    DeepSpeed's order, so code written against DeepSpeed unpacks it the same way. Use
    `estimate_memory` for named fields. ``cpu_offload`` is optimizer offload;
    ``cpu_offload_params`` only counts together with it, as in DeepSpeed.
    """
    _check_args(
        "estimate_zero3_model_states_mem_needs",
        total_params,
        largest_layer_params,
        num_gpus_per_node,
        num_nodes,
        additional_buffer_factor,
    )
    total_gpus = num_nodes * num_gpus_per_node
    # The CPU figure is per node: the states spread over the nodes, not over each node's GPUs.
    per_node = 1 / num_nodes
    # The largest layer is gathered whole, in fp32-sized slots, on every GPU.
    largest_layer_memory = 4 * largest_layer_params
    # Without zero.Init every GPU's process first builds the whole model on the CPU (4 bytes
    # per param each), which can exceed the steady-state CPU need.
    whole_model_per_node = 4 * num_gpus_per_node
    # The operand order below matches DeepSpeed's, so float rounding, and the int() after it,
    # give the same bytes.
    if cpu_offload:
        # Optimizer states (and fp32 master weights, gradients) live on the CPU.
        per_param = 18 if cpu_offload_params else 16
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
        else:
            # The fp16 params stay partitioned on the GPUs.
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
        if zero_init:
            cpu_mem = total_params * per_param * per_node * additional_buffer_factor
        else:
            cpu_mem = (
                total_params
                * max(whole_model_per_node, per_param * per_node)
                * additional_buffer_factor
            )
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            # Only one layer at a time passes through the CPU on each GPU's process.
            cpu_mem = largest_layer_params * whole_model_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * whole_model_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def _estimates(
    caller: str,
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int,
    num_nodes: int,
    additional_buffer_factor: float,
) -> list[MemoryEstimate]:
    _check_args(
        caller,
        total_params,
        largest_layer_params,
        num_gpus_per_node,
        num_nodes,
        additional_buffer_factor,
    )
    rows = []
    for offload_optimizer, offload_param in _OFFLOAD_CHOICES:
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total_params=total_params,
                largest_layer_params=largest_layer_params,
                num_gpus_per_node=num_gpus_per_node,
                num_nodes=num_nodes,
                cpu_offload=offload_optimizer,
                cpu_offload_params=offload_param,
                zero_init=zero_init,
                additional_buffer_factor=additional_buffer_factor,
            )
            rows.append(
                MemoryEstimate(
                    offload_param=offload_param,
                    offload_optimizer=offload_optimizer,
                    zero_init=zero_init,
                    per_gpu_bytes=gpu,
                    per_cpu_bytes=cpu,
                )
            )
    return rows


def _numel(param: torch.Tensor) -> int:
    # A ZeRO-3 partitioned parameter's .data is empty; ds_numel is its full size.
    return int(getattr(param, "ds_numel", param.numel()))


def _param_key(param: nn.Parameter) -> tuple[str, int]:
    # Distinct Parameter objects over the same storage (DeepSpeed dedups by data_ptr) count
    # once. Partitioned, meta and empty tensors have no meaningful pointer: count by identity.
    if (
        not hasattr(param, "ds_numel")
        and param.numel() > 0
        and param.device.type != "meta"
        and param.data_ptr() != 0
    ):
        return ("ptr", param.data_ptr())
    return ("id", id(param))


def _model_params(model: nn.Module) -> tuple[int, int]:
    """(total params, largest number of params owned directly by one module)."""
    sizes = {_param_key(p): _numel(p) for p in model.parameters()}
    largest = 0
    for module in model.modules():
        largest = max(largest, sum(_numel(p) for p in module.parameters(recurse=False)))
    return sum(sizes.values()), largest


def estimate_memory(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
    *,
    shard_size: int | None = None,
    hpz_partition_size: int = 1,
    node_local_accumulation: bool = False,
) -> list[MemoryEstimate]:
    """The rows of DeepSpeed's ZeRO-3 estimate table for `model`, in the table's order.

    Parameters are counted at full size even when already partitioned (``ds_numel``), so it
    works before or after ``zero.Init``; a model on the ``meta`` device works too. The largest
    layer is the module owning the most parameters directly (not through its children).
    zstack's keywords: `shard_size`, hybrid sharding's (``mics_shard_size``: the states spread
    over that many GPUs, each node holding its GPUs' shard groups); `hpz_partition_size`,
    hpZ's secondary shards added to each GPU (`MemoryEstimate.secondary_bytes`);
    `node_local_accumulation`, its held gradients added to each GPU when there are several
    nodes (`MemoryEstimate.accumulation_bytes`; not with `shard_size`, as the config refuses).
    """
    total, largest = _model_params(model)
    gpus, nodes, hosts = num_gpus_per_node, num_nodes, 1.0
    if shard_size is not None:
        _check_count("estimate_memory", "shard_size", shard_size, 1)
        if (num_gpus_per_node * num_nodes) % shard_size:
            raise ValueError(
                f"estimate_memory(shard_size={shard_size}): must divide the "
                f"{num_gpus_per_node * num_nodes} GPUs"
            )
        # one shard group's states, as a setup of its own; a node hosts its GPUs' groups
        gpus, nodes = min(shard_size, num_gpus_per_node), max(1, shard_size // num_gpus_per_node)
        hosts = max(1.0, num_gpus_per_node / shard_size)
    _check_count("estimate_memory", "hpz_partition_size", hpz_partition_size, 1)
    secondary = 0 if hpz_partition_size == 1 else int(2 * total / hpz_partition_size)
    if node_local_accumulation and shard_size is not None:
        raise ValueError(
            "estimate_memory(node_local_accumulation=True, shard_size=...): hybrid sharding "
            "keeps the reductions within its shard groups already; one or the other"
        )
    held = node_local_accumulation and num_nodes > 1
    accumulation = int(2 * total / num_gpus_per_node) if held else 0
    rows = _estimates("estimate_memory", total, largest, gpus, nodes, additional_buffer_factor)
    return [
        replace(
            row,
            per_cpu_bytes=int(row.per_cpu_bytes * hosts),
            per_gpu_bytes=row.per_gpu_bytes + secondary + accumulation,
            secondary_bytes=secondary,
            accumulation_bytes=accumulation,
        )
        for row in rows
    ]


def _print_table(
    model: str, rows: list[tuple[int, int, str]], num_gpus_per_node: int, num_nodes: int
) -> None:
    """DeepSpeed's table: the setup, `model` (what the SW line says after "Model with"), and
    a line per (per-CPU bytes, per-GPU bytes, options) row; on rank 0 only when a process
    group is up."""
    if zcomm.is_initialized() and zcomm.get_rank() != 0:
        return
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:",
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.",
        f"SW: Model with {model}.",
        "  per CPU  |  per GPU |   Options",
    ]
    lines += [f" {cpu / _GB:7.2f}GB | {gpu / _GB:6.2f}GB | {options}" for cpu, gpu, options in rows]
    print("\n".join(lines))


def _print_zero3_table(
    rows: list[MemoryEstimate],
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int,
    num_nodes: int,
) -> None:
    model = (
        f"{int(total_params / 1e6)}M total params, "
        f"{int(largest_layer_params / 1e6)}M largest layer params"
    )
    table = [(row.per_cpu_bytes, row.per_gpu_bytes, row.options()) for row in rows]
    _print_table(model, table, num_gpus_per_node, num_nodes)


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print DeepSpeed's ZeRO-3 memory table for a model given by its parameter counts.

    For a model that does not exist yet; with the model at hand use
    `estimate_zero3_model_states_mem_needs_all_live`. Printed on rank 0 only when a process
    group is up.
    """
    rows = _estimates(
        "estimate_zero3_model_states_mem_needs_all_cold",
        total_params,
        largest_layer_params,
        num_gpus_per_node,
        num_nodes,
        additional_buffer_factor,
    )
    _print_zero3_table(rows, total_params, largest_layer_params, num_gpus_per_node, num_nodes)


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print DeepSpeed's ZeRO-3 memory table for `model` (counted as `estimate_memory` does).

    Printed on rank 0 only when a process group is up.
    """
    total, largest = _model_params(model)
    rows = _estimates(
        "estimate_zero3_model_states_mem_needs_all_live",
        total,
        largest,
        num_gpus_per_node,
        num_nodes,
        additional_buffer_factor,
    )
    _print_zero3_table(rows, total, largest, num_gpus_per_node, num_nodes)


# -- ZeRO-2 ----------------------------------------------------------------------------------


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """The model-state memory of one ZeRO-2 configuration, in bytes: ``(per_cpu_bytes,
    per_gpu_bytes)``, in DeepSpeed's order. Every GPU holds the 16-bit parameters (2 bytes
    each); without ``cpu_offload`` also its share of the 16-bit and fp32 gradients, fp32
    masters and Adam's moments (18 bytes a parameter over the GPUs), with it those are on the
    host (at least 16 bytes a parameter, 4 per GPU for the gradients' staging)."""
    _check_args(
        "estimate_zero2_model_states_mem_needs",
        total_params,
        0,
        num_gpus_per_node,
        num_nodes,
        additional_buffer_factor,
    )
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print DeepSpeed's ZeRO-2 memory table for a model given by its parameter count (with
    and without optimizer offload). Printed on rank 0 only when a process group is up."""
    rows = [
        (
            *estimate_zero2_model_states_mem_needs(
                total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor
            ),
            f"offload_optimizer={'cpu ' if offload else 'none'}",
        )
        for offload in (True, False)
    ]
    model = f"{int(total_params / 1e6)}M total params"
    _print_table(model, rows, num_gpus_per_node, num_nodes)


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print DeepSpeed's ZeRO-2 memory table for `model` (shared parameters counted once)."""
    total, _ = _model_params(model)
    estimate_zero2_model_states_mem_needs_all_cold(
        total, num_gpus_per_node, num_nodes, additional_buffer_factor
    )
