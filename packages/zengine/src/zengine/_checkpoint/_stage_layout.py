"""Which stage of a pipeline checkpoint holds which parameters, and whether they fit a pipeline.

A pipeline checkpoint is one engine checkpoint per stage (``stage<s>/<tag>``), each keyed by
parameter name. zengine's `PipelineModule` registers a layer under its *global* index
(``"3.up.weight"``) and a tied layer under its key (``"tied_modules.embed.weight"``), so a name
means the same parameter whatever stage held it: the manifests of the stages say where every
name lies, and a module of another partition or stage count finds each of its names in one old
stage. What the manifests do not say, the number of stages, lies in ``pipeline-<tag>.json``
next to ``latest`` (a `StageLayout`, which the pipeline makes of its module).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zengine._checkpoint import _files as files
from zengine._checkpoint._engine_view import StageEngine
from zengine._checkpoint._errors import CorruptCheckpointError
from zengine._checkpoint._manifest import (
    FORMAT,
    describe,
    name_differences,
    optimizer_differences,
    param_differences,
)

__all__ = [
    "PipelineLayers",
    "StageLayout",
    "layout_path",
    "mismatches",
    "names",
    "owners",
    "read_layout",
    "read_manifests",
    "stage_description",
    "stage_dir",
    "write_layout",
]

LAYOUT_FORMAT = 1


def stage_dir(root: Path, stage: int) -> Path:
    return root / f"stage{stage}"


def layout_path(root: Path, tag: str) -> Path:
    return root / f"pipeline-{tag}.json"


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """How the saved pipeline was split: the stage count is what a load needs (to find the
    stage directories), the layer count is checked, the rest is said in errors and logs."""

    stages: int
    layers: int
    chunks: int
    parts: list[int]


@dataclasses.dataclass(frozen=True)
class PipelineLayers:
    """What the pipeline engine adds to a save's or a load's options: what its module says of
    its layers (pipe/_checkpoint.py makes it of the `PipelineModule`). `layout`: how it is
    split (saved, and checked on load); `label`: a parameter's name as errors give it, with its
    layer; `prefix`: the prefix of a layer's parameters' names by its global index (to read
    DeepSpeed's layer files)."""

    layout: StageLayout
    label: Callable[[str], str]
    prefix: Callable[[int], str]


def write_layout(root: Path, tag: str, layout: StageLayout) -> None:
    record = {"format": LAYOUT_FORMAT, "tag": tag, **dataclasses.asdict(layout)}
    files.write_atomic(layout_path(root, tag), json.dumps(record, indent=1).encode())


def read_layout(root: Path, tag: str) -> StageLayout | None:
    """The layout saved with `tag`; None for a checkpoint saved without one (before zengine
    wrote it, or when writing it failed): each stage then loads its own directory."""
    path = layout_path(root, tag)
    try:
        record = json.loads(path.read_text())
        if record.get("format") != LAYOUT_FORMAT:
            raise CorruptCheckpointError(
                f"{path}: format {record.get('format')!r}, this zengine reads {LAYOUT_FORMAT}"
            )
        return StageLayout(
            int(record["stages"]), int(record["layers"]), int(record["chunks"]), record["parts"]
        )
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise CorruptCheckpointError(f"{path} is corrupt: {error!r}") from None


def read_manifests(root: Path, tag: str, stages: int) -> list[dict[str, Any]]:
    """Every saved stage's manifest; an error naming a stage directory that is missing."""
    return [files.read_manifest(stage_dir(root, s) / tag) for s in range(stages)]


def names(description: dict[str, Any]) -> set[str]:
    """The parameters and buffers a manifest (or `describe`) lists."""
    return set(description["params"]) | set(description["buffers"])


def stage_description(engine: StageEngine) -> dict[str, Any]:
    """What this stage's module holds, in the manifest's terms (`describe`), with its stage."""
    return {**describe(engine), "stage": engine.stage_id}


def _merged(descriptions: list[dict[str, Any]]) -> dict[str, Any]:
    """One description of a whole pipeline from its stages' (in stage order: a tied weight
    held by several stages is described by the lowest)."""
    params: dict[str, Any] = {}
    buffers: dict[str, Any] = {}
    for d in descriptions:
        params = {**d["params"], **params}
        buffers = {**d["buffers"], **buffers}
    first = descriptions[0]
    return {
        "params": params,
        "buffers": buffers,
        "optimizer": first["optimizer"],
        "param_groups": first["param_groups"],
    }


def _labelled(description: dict[str, Any], label: Callable[[str], str]) -> dict[str, Any]:
    return {
        **description,
        "params": {label(n): v for n, v in description["params"].items()},
        "buffers": {label(n): v for n, v in description["buffers"].items()},
    }


def mismatches(
    layout: StageLayout,
    saved: list[dict[str, Any]],
    now: list[dict[str, Any]],
    *,
    layers: int,
    label: Callable[[str], str],
    optimizer: bool,
) -> list[str]:
    """Every difference between the checkpoint (its layout and its stages' manifests) and the
    pipeline (its `layers` and its stages' descriptions), each parameter named as `label` names
    it (with its layer); empty when the checkpoint loads into the pipeline whatever the
    partitions."""
    problems = [
        f"stage {s}: checkpoint format {m.get('format')!r}, this zengine reads {FORMAT}"
        for s, m in enumerate(saved)
        if m.get("format") != FORMAT
    ]
    if problems:
        return problems
    if layout.layers != layers:
        problems.append(f"layers: {layout.layers} in the checkpoint, {layers} in the model")
    # the manifest's own comparisons, on names that say their layer
    old, new = _labelled(_merged(saved), label), _labelled(_merged(now), label)
    problems += name_differences(old, new) + param_differences(old, new)
    if optimizer:
        problems += optimizer_differences(old, new)
    return problems


def owners(saved: list[dict[str, Any]]) -> dict[str, int]:
    """For every name in the checkpoint, the lowest stage that saved it (a tied weight is
    saved, equal, by every stage that holds it: the lowest stage's copy is the one
    `PipelineModule.sync_tied_weights` hands the others too)."""
    found: dict[str, int] = {}
    for s, manifest in enumerate(saved):
        for name in names(manifest):
            found.setdefault(name, s)
    return found
