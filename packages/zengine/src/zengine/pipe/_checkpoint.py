"""The pipeline engine's ``save_checkpoint`` and ``load_checkpoint``: a checkpoint in stages.

The format, the save and the load into other stages and partitions are the checkpoint
package's (zengine/_checkpoint/_stages.py); here is what they record of the `PipelineModule`:
its layout (stages, layers, chunks, partition), and its layers in the names of parameters that
do not fit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zengine._checkpoint import StageLayout, load_stages, save_stages
from zengine.pipe._module import PipelineModule
from zengine.pipe._specs import TiedLayerSpec

if TYPE_CHECKING:
    from zengine.pipe._engine import PipelineEngine

__all__ = ["load_checkpoint", "save_checkpoint"]


def module_layout(module: PipelineModule) -> StageLayout:
    return StageLayout(
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


def save_checkpoint(
    engine: PipelineEngine,
    save_dir: str | os.PathLike[str],
    tag: str | None,
    client_state: dict[str, Any] | None,
    save_latest: bool,
    exclude_frozen_parameters: bool = False,
) -> bool:
    return save_stages(
        engine,
        save_dir,
        tag,
        client_state,
        save_latest,
        exclude_frozen_parameters,
        layout=module_layout(engine.module),
    )


def load_checkpoint(
    engine: PipelineEngine,
    load_dir: str | os.PathLike[str],
    tag: str | None,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    *,
    load_module_strict: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    return load_stages(
        engine,
        load_dir,
        tag,
        load_optimizer_states,
        load_lr_scheduler_states,
        layout=module_layout(engine.module),
        label=_labeller(engine.module),
        prefix=_prefixer(engine.module),
        load_module_strict=load_module_strict,
        load_module_only=load_module_only,
    )
