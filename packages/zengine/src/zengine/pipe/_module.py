"""`PipelineModule`: a model given as a list of layers, of which each stage builds only its own.

The layers are split into ``num_stages * chunks`` contiguous parts (see _partition.py); part
``chunk * num_stages + stage`` is chunk `chunk` of stage `stage` (its *virtual stage*), so with
one chunk part `s` is stage `s`, and with several the model wraps around the stages as
interleaved schedules expect. A `TiedLayerSpec` key is built once per stage that uses it, and
kept equal across those stages by the engine (see `tied_*` below).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

import zcomm
from zcomm.topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology
from zengine import _recompute as checkpointing
from zengine.pipe._partition import layer_name, partition_layers
from zengine.pipe._specs import LayerSpec, TiedLayerSpec

__all__ = ["PipelineModule"]

# a layer maps the activations before it to those after: the model's own values, of any kind
Layer = Callable[[Any], Any]


def _topology(num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
    world = zcomm.get_world_size()
    if topology is not None:
        pipe = topology.get_dim("pipe")
        if num_stages is not None and pipe != num_stages:
            raise ValueError(
                f"PipelineModule: num_stages={num_stages}, but the topology's pipe axis has {pipe}"
            )
        return topology
    if num_stages is None:
        raise ValueError("PipelineModule: give num_stages or topology")
    if num_stages < 1 or world % num_stages:
        raise ValueError(
            f"PipelineModule(num_stages={num_stages}): the world of {world} ranks does not "
            "split into that many stages"
        )
    return PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule``: `layers` (modules, callables, `LayerSpec`s) run in
    order, split over `num_stages` stages (or the `topology`'s pipe axis).

    Args:
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage; without it the last layer's
            output is the loss.
        seed_layers: seed the RNG with ``base_seed + index`` before building each layer, so
            a layer starts the same whichever stage builds it (`seed_fn` sets the seed).
        partition_method: ``parameters``, ``uniform``, ``type:REGEX``, or the boundaries as a
            list of ``num_stages * chunks + 1`` layer indices.
        activation_checkpoint_interval: checkpoint this stage's layers in segments of this
            many (0: none): a segment's activations are recomputed in the backward, if one of
            its layers has parameters, or with `checkpointable_layers` (class names) if all
            its layers are named there. `set_checkpoint_interval` changes it.
        activation_checkpoint_func: ``func(function, *args)`` that checkpoints a segment;
            by default `zengine.checkpointing.reentrant_checkpoint` (DeepSpeed's default is
            its reentrant ``checkpoint``); ``pipeline.use_reentrant: false`` in the config
            replaces it with ``checkpointing.non_reentrant_checkpoint``.
        dynamic_shape: accepted for DeepSpeed compatibility: activations of a new shape are
            always sent with their shape.
        chunks: model chunks per stage, for interleaved schedules.
    """

    def __init__(
        self,
        layers: Iterable[LayerSpec | Layer],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], object] | None = None,
        base_seed: int = 1234,
        partition_method: str | Sequence[int] = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
        *,
        chunks: int = 1,
    ) -> None:
        super().__init__()
        layers = list(layers)  # an nn.Sequential or nn.ModuleList too
        if not layers:
            raise ValueError("PipelineModule: layers is empty")
        if chunks < 1:
            raise ValueError(f"PipelineModule(chunks={chunks}): must be at least 1")
        _check_interval(activation_checkpoint_interval)
        zcomm.init_distributed()
        self._topo = _topology(num_stages, topology)
        self._grid = PipelineParallelGrid(topology=self._topo)
        self.num_stages = self._grid.pipe_parallel_size
        self.stage_id = self._grid.get_stage_id()
        self.chunks = chunks
        self.loss_fn = loss_fn
        self.dynamic_shape = dynamic_shape
        #: read by every training forward; the engine sets it from the config (when positive),
        #: `set_checkpoint_interval` at any time
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = (
            activation_checkpoint_func or checkpointing.reentrant_checkpoint
        )
        self.checkpointable_layers = checkpointable_layers
        #: DeepSpeed's: per segment of this stage's layers (chunk after chunk), whether it is
        #: checkpointed, for the interval in `is_checkpointable_results_interval`
        self.is_checkpointable_results: list[bool] = []
        self.is_checkpointable_results_interval: int | None = None
        #: the same per chunk, as (first layer, end, checkpointed) positions in `chunk_layers`
        self._segments: list[list[tuple[int, int, bool]]] = []
        self._layer_specs = list(layers)
        self.parts = partition_layers(self._layer_specs, self.num_stages * chunks, partition_method)
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        #: per chunk of this stage, (global layer index, the callable) in order
        self.chunk_layers: list[list[tuple[int, Layer]]] = []
        seed = seed_fn or torch.manual_seed
        for chunk in range(chunks):
            lo, hi = self._bounds(chunk)
            built = []
            for index in range(lo, hi):
                if seed_layers:
                    seed(base_seed + index)
                built.append((index, self._build(index, self._layer_specs[index])))
            self.chunk_layers.append(built)
        self._tied_groups = self._make_tied_groups()

    # -- the layout ----------------------------------------------------------------------------

    def _bounds(self, chunk: int) -> tuple[int, int]:
        part = chunk * self.num_stages + self.stage_id
        return self.parts[part], self.parts[part + 1]

    def virtual_stage(self, chunk: int) -> int:
        """The part of the model chunk `chunk` of this stage runs."""
        return chunk * self.num_stages + self.stage_id

    def _build(self, index: int, layer: object) -> Layer:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            if layer.forward_fn is None:
                return module
            forward_fn = layer.forward_fn
            return lambda x: forward_fn(module, x)
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
            return layer
        if callable(layer):
            return layer
        raise TypeError(
            f"PipelineModule: layer {index} is a {type(layer).__name__}; expected an "
            "nn.Module, a LayerSpec or a callable"
        )

    def topology(self) -> ProcessTopology:
        """The pipe x data topology the stages run on."""
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        """The grid: this rank's stage, its data-parallel group and its pipeline."""
        return self._grid

    # -- forward -------------------------------------------------------------------------------

    def forward(self, forward_input: Any, chunk: int = 0) -> Any:
        """Run this stage's layers of `chunk` on `forward_input`, in training checkpointed in
        segments of `activation_checkpoint_interval` layers."""
        layers = self.chunk_layers[chunk]
        if self.activation_checkpoint_interval <= 0 or not self.training:
            return self._run(layers, forward_input)
        # the interval may have been assigned directly since the last forward, as DeepSpeed's
        # engine does before it calls this
        self._precompute_checkpointable_values()
        x = forward_input
        for start, stop, checkpointed in self._segments[chunk]:
            if checkpointed:
                x = self._checkpointed(layers[start:stop], x)
            else:
                x = self._run(layers[start:stop], x)
        return x

    @staticmethod
    def _run(layers: Sequence[tuple[int, Layer]], x: Any) -> Any:
        for _, layer in layers:
            x = layer(x)
        return x

    def _checkpointed(self, layers: Sequence[tuple[int, Layer]], x: Any) -> Any:
        """`layers` on `x` through `activation_checkpoint_func`, which takes the input's
        tensors as positional arguments, as DeepSpeed passes a tuple payload: a reentrant
        checkpoint sends gradients to those only, and returns only tensors it was given back
        at the top (here the output's leaves, rebuilt into its structure after)."""
        leaves, spec = pytree.tree_flatten(x)
        out_spec: list[pytree.TreeSpec] = []  # set by each run: the forward and its recompute

        def run(*inputs: Any) -> tuple[Any, ...]:
            out = self._run(layers, pytree.tree_unflatten(list(inputs), spec))
            flat, found = pytree.tree_flatten(out)
            out_spec[:] = [found]
            return tuple(flat)

        flat_out = self.activation_checkpoint_func(run, *leaves)
        return pytree.tree_unflatten(list(flat_out), out_spec[0])

    # -- which layers are checkpointed (DeepSpeed's names) -------------------------------------

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint in segments of `interval` layers from the next forward (0: none)."""
        _check_interval(interval)
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def _precompute_checkpointable_values(self) -> None:
        """Split each chunk's layers into segments of `activation_checkpoint_interval` and
        decide which are checkpointed, once per interval: the results of another interval
        would not line up with the segments the forward makes."""
        interval = self.activation_checkpoint_interval
        if interval <= 0 or self.is_checkpointable_results_interval == interval:
            return
        self._segments = [self._split(layers, interval) for layers in self.chunk_layers]
        self.is_checkpointable_results = [c for chunk in self._segments for _, _, c in chunk]
        self.is_checkpointable_results_interval = interval

    def _split(
        self, layers: Sequence[tuple[int, Layer]], interval: int
    ) -> list[tuple[int, int, bool]]:
        ends = [(i, min(i + interval, len(layers))) for i in range(0, len(layers), interval)]
        return [(i, j, self._is_checkpointable([f for _, f in layers[i:j]])) for i, j in ends]

    def _is_checkpointable(self, funcs: Sequence[Layer]) -> bool:
        """Whether a segment of these layers is checkpointed (DeepSpeed's rule): all of them
        named in `checkpointable_layers`, or without that list, one of them has parameters
        (recomputing a segment without any saves little and costs a forward)."""
        if self.checkpointable_layers is not None:
            return all(layer_name(f) in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    # -- tied weights --------------------------------------------------------------------------

    def _tied_stages(self) -> dict[str, list[int]]:
        """For every tied key in the model, the stages that hold it."""
        stages: dict[str, set[int]] = {}
        for part in range(len(self.parts) - 1):
            for index in range(self.parts[part], self.parts[part + 1]):
                layer = self._layer_specs[index]
                if isinstance(layer, TiedLayerSpec):
                    stages.setdefault(layer.key, set()).add(part % self.num_stages)
        return {key: sorted(found) for key, found in sorted(stages.items())}

    def _make_tied_groups(self) -> dict[str, tuple[list[int], torch.distributed.ProcessGroup]]:
        """One group per (key, data-parallel index) over the stages holding the key; every
        rank creates every group, in the same order (torch requires it)."""
        mine = {}
        me = zcomm.get_rank()
        for key, stages in self._tied_stages().items():
            if len(stages) < 2:
                continue
            for data in range(self._grid.get_data_parallel_world_size()):
                ranks = [self._topo.get_rank(pipe=s, data=data) for s in stages]
                group = zcomm.new_group(ranks)
                if me in ranks:
                    mine[key] = (ranks, group)
        return mine

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """The tied weights of `key` on this stage."""
        module = self.tied_modules[key]
        return [getattr(module, attr) for attr in self.tied_weight_attrs[key]]

    def tied_copies(self) -> list[nn.Parameter]:
        """Tied weights this stage holds as a copy (a lower stage holds them too): a global
        gradient norm counts them once, on the lowest stage."""
        return [
            p
            for key, (ranks, _) in self._tied_groups.items()
            if ranks[0] != zcomm.get_rank()
            for p in self.tied_parameters(key)
        ]

    def sync_tied_weights(self) -> None:
        """Copy each tied weight from the lowest stage holding it to the others."""
        for key, (ranks, group) in self._tied_groups.items():
            for p in self.tied_parameters(key):
                zcomm.broadcast(p.data, ranks[0], group=group)

    def allreduce_tied_grads(self, grad_of: Callable[[nn.Parameter], torch.Tensor]) -> None:
        """Sum each tied weight's gradient over the stages holding it (``ReduceTiedGrads``).
        `grad_of`: where a weight's accumulated gradient lies (the engine's layout knows: its
        ``.grad``, or the wide buffer when it accumulates in another dtype)."""
        for key, (_, group) in self._tied_groups.items():
            for p in self.tied_parameters(key):
                zcomm.all_reduce(grad_of(p), group=group)


def _check_interval(interval: int) -> None:
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(
            f"PipelineModule: activation_checkpoint_interval={interval!r}; expected a whole "
            "number of layers, 0 for no checkpointing"
        )
