"""The pipeline engine's ``save_checkpoint`` and ``load_checkpoint``: a checkpoint in stages.

The format, the save and the load into other stages and partitions are the checkpoint
package's (zengine/_checkpoint/_stages.py); here is what they record of the `PipelineModule`,
added to the engine's options: its layout (stages, layers, chunks, partition), and its layers
in the names of parameters that do not fit (`PipelineLayers`). The checkpoint package's
names are looked up at first use: its modules that import torch.distributed.checkpoint load
then, not with the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from zengine import _checkpoint
from zengine._checkpoint import LoadOptions, SaveOptions, StageEngine
from zengine.pipe._module import PipelineModule
from zengine.pipe._specs import TiedLayerSpec

__all__ = ["load_checkpoint", "pipeline_layers", "save_checkpoint"]


def module_layout(module: PipelineModule) -> _checkpoint.StageLayout:
    return _checkpoint.StageLayout(
        module.num_stages, len(module._layer_specs), module.chunks, list(module.parts)
    )


def _labeller(module: PipelineModule) -> Callable[[str], str]:
    """``name -> "name (layer i)"``: errors name the layer a parameter belongs to."""
    tied: dict[str, list[int]] = {}
    for index, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            tied.setdefault(spec.key, []).append(index)

    def label(name: str) -> str:
        head, _, rest = name.partition(".")
        if head.isdigit():
            return f"{name} (layer {head})"
        if head == "tied_modules":
            key = rest.partition(".")[0]
            where = ", ".join(map(str, tied.get(key, []))) or "none in the model"
            return f"{name} (tied {key!r}, layers {where})"
        return name

    return label


def _prefixer(module: PipelineModule) -> Callable[[int], str]:
    """``layer index -> the prefix of its parameters' names`` (``"3."``, or
    ``"tied_modules.embed."`` for a tied layer), as DeepSpeed's layer files need."""
    specs = module._layer_specs

    def prefix(index: int) -> str:
        spec = specs[index] if index < len(specs) else None
        return f"tied_modules.{spec.key}." if isinstance(spec, TiedLayerSpec) else f"{index}."

    return prefix


def pipeline_layers(module: PipelineModule) -> _checkpoint.PipelineLayers:
    """What a checkpoint records and says of `module`'s layers."""
    return _checkpoint.PipelineLayers(module_layout(module), _labeller(module), _prefixer(module))


class PipeStage(StageEngine, Protocol):
    """A pipeline engine as its checkpoint reads it: one stage, over a `PipelineModule`
    (declared here so that this module need not import the engine that calls it)."""

    @property
    def module(self) -> PipelineModule: ...


def save_checkpoint(engine: PipeStage, options: SaveOptions) -> bool:
    return _checkpoint.save_stages(engine, options, pipeline_layers(engine.module))


def load_checkpoint(
    engine: PipeStage, options: LoadOptions
) -> tuple[str | None, dict[str, Any] | None]:
    return _checkpoint.load_stages(engine, options, pipeline_layers(engine.module))
