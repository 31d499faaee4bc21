"""Checkpoints of a pipeline in stages: each stage a checkpoint of its own, one ``latest`` for
all; a load into any number of stages, any partition of the same layers, any data-parallel size.
The pipeline engine's save and load (zengine/pipe/_checkpoint.py) are these, given the save's
or the load's options and what the checkpoint records of the `PipelineModule`, its
`PipelineLayers`: its `StageLayout`, and its layers' names in errors.

The format, under ``save_dir``:

- ``stage<s>/<tag>/``: stage s's layers (and its data-parallel replicas' shards), saved as
  zengine saves any engine (_save_load.py: DCP files keyed by parameter name, a
  manifest ``zengine.json`` listing every parameter and buffer with its shape, CRCs), without
  a ``latest`` of its own. A `PipelineModule` names a layer's parameters by the layer's global
  index (``3.up.weight``) and a tied layer's by its key (``tied_modules.embed.weight``, saved by
  every stage that holds it, equal), so a name means the same parameter on any stage.
- ``pipeline-<tag>.json``: the number of stages (what a load needs to find the directories),
  of layers and of chunks, and the partition.
- ``latest``: the newest tag, for all stages.

Once every stage's save succeeded, which all ranks agree on, world rank 0 writes
``pipeline-<tag>.json`` and then ``latest``; a stage that failed fails the save on every stage,
and ``latest`` keeps naming the previous checkpoint, whole on every stage.

A load first checks, on every rank, the checkpoint's layers (every saved stage's manifest)
against the module's (every stage's parameters, gathered over the pipeline): a missing stage
directory, another layer count, a parameter missing, extra, of another shape or optimizer
group fails the load on every rank, naming the layers and parameters, before anything is
loaded. Then a stage whose saved directory holds exactly its names (same stages, same
partition) loads that directory as before; any other stage reads each of its names from an
old stage that saved it (_stage_reshape.py). Either way DCP reshards each name over the
stage's data-parallel ranks and ZeRO stage. A checkpoint without ``pipeline-<tag>.json``
(saved before it existed) loads only into the same stages. Every stage checks every file it
will read against its CRC before any stage reads one, so a damaged file loads nothing anywhere;
a stage that fails later (a read error) still fails the load on every stage.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import zcomm
from zengine._checkpoint import _files as files
from zengine._checkpoint import _stage_reshape as reshape
from zengine._checkpoint._ds_files import resolve_deepspeed
from zengine._checkpoint._ds_load import group_names, load_deepspeed
from zengine._checkpoint._ds_pipeline import DeepSpeedPipelineCheckpoint, is_pipeline
from zengine._checkpoint._engine_view import StageEngine
from zengine._checkpoint._errors import CheckpointError, CheckpointMismatchError
from zengine._checkpoint._options import LoadOptions, SaveOptions
from zengine._checkpoint._recovery import write_recovery_script
from zengine._checkpoint._save_load import (
    engine_sync,
    load_checkpoint,
    save_checkpoint,
    verify_files,
)
from zengine._checkpoint._stage_layout import (
    PipelineLayers,
    layout_path,
    mismatches,
    names,
    read_layout,
    read_manifests,
    stage_description,
    stage_dir,
    write_layout,
)
from zengine._checkpoint._stage_reshape import Sources
from zengine._checkpoint._state import persistent_buffers
from zengine._checkpoint._sync import ERROR_KINDS, Sync

__all__ = ["load_stages", "save_stages"]

T = TypeVar("T")

log = logging.getLogger("zengine")


def _world(engine: StageEngine) -> Sync:
    """Agreement over every rank of every stage."""
    return Sync(None, engine.config.checkpoint.timeout)


def _on_every_stage(
    engine: StageEngine, work: Callable[[], T], elsewhere: Callable[[list[int]], str]
) -> T:
    """`work` on this stage, then every stage learns which failed and why: a stage's own error
    is raised there, the others raise ``elsewhere(failed stages)`` followed by each failed
    stage's error, of the first one's class when that is a checkpoint error (an
    `UnsafeCheckpointError` names the file and the type on every stage)."""
    error: BaseException | None = None
    result = None
    try:
        result = work()
    except Exception as exc:  # reported to every stage, then raised here
        error = exc
    said = None if error is None else (engine.stage_id, type(error).__name__, str(error))
    failed = sorted({s for s in _world(engine).gather(said) if s is not None})
    if error is not None:
        raise error
    if failed:
        stages = sorted({stage for stage, _, _ in failed})
        kind = next((k for k in ERROR_KINDS if k.__name__ == failed[0][1]), CheckpointError)
        detail = "\n  ".join(dict.fromkeys(f"stage {s}: {m}" for s, _, m in failed))
        raise kind(f"{elsewhere(stages)}:\n  {detail}")
    return cast(T, result)


def save_stages(engine: StageEngine, options: SaveOptions, layers: PipelineLayers) -> bool:
    """``engine.save_checkpoint`` of a pipeline engine whose module's layers are `layers`:
    each stage saves its own checkpoint under ``save_dir/stage<s>`` as `options` say, without
    a ``latest`` or a ``zero_to_fp32.py`` of its own; rank 0 then writes the layout,
    ``latest`` and ``zero_to_fp32.py`` for all."""
    save_dir = options.save_dir
    if not save_dir:  # DeepSpeed's ValueError; Path("") would be the current directory
        raise ValueError(f"save_checkpoint: save_dir must be a non-empty path, got {save_dir!r}")
    root = Path(save_dir)
    tag = str(options.tag) if options.tag is not None else f"global_step{engine.global_steps}"
    stage = dataclasses.replace(
        options,
        save_dir=stage_dir(root, engine.stage_id),
        tag=tag,
        save_latest=False,
        recovery_script=False,
    )
    _on_every_stage(
        engine,
        lambda: save_checkpoint(engine, stage),
        lambda failed: (
            f"save_checkpoint({str(root)!r}, tag={tag!r}): stage(s) {failed} failed to save; "
            f"'{files.LATEST}' still names the previous checkpoint"
        ),
    )
    problem = None
    if zcomm.get_rank() == 0:
        try:
            write_layout(root, tag, layers.layout)
            if options.save_latest:
                files.write_atomic(root / files.LATEST, tag.encode())
            write_recovery_script(root)
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
    # also the barrier: 'latest' is written before anyone goes on
    _world(engine).agree(
        f"save_checkpoint({str(root)!r}, tag={tag!r}): writing "
        f"{layout_path(root, tag).name} and '{files.LATEST}' on rank 0",
        problem,
    )
    return True


def load_stages(
    engine: StageEngine, options: LoadOptions, layers: PipelineLayers
) -> tuple[str | None, dict[str, Any] | None]:
    """``engine.load_checkpoint`` of a pipeline engine whose module's layers are `layers`
    (their layout checked against the checkpoint's, errors naming each parameter with its
    layer, DeepSpeed's layer files found by each layer's names)."""
    root = Path(options.load_dir)
    deepspeed = resolve_deepspeed(root, options.tag)
    if deepspeed is not None:
        return _load_deepspeed_stages(engine, deepspeed, options, layers)
    tag = options.tag
    if tag is None:
        tag = files.read_latest(root)
        if tag is None:
            log.warning("zengine: no '%s' file in %s: no checkpoint loaded", files.LATEST, root)
            return None, None
    where = f"load_checkpoint({str(root)!r}, tag={tag!r})"
    sources = _sources(engine, root, tag, options.load_optimizer_states, where, layers)
    if sources is not None and (options.load_module_only or not options.load_module_strict):
        raise CheckpointError(  # the same files on every stage: each raises it alike
            f"{where}: the checkpoint was saved with other stage boundaries; it loads with "
            "load_module_strict=True and load_module_only=False only"
        )
    _on_every_stage(
        engine,
        lambda: _verify_stage(engine, root, tag, sources),
        lambda failed: (
            f"{where}: stage(s) {failed} found damaged or missing files (their error is raised "
            "there); nothing was loaded"
        ),
    )
    # every file was checked above, on every stage: none is read twice
    stage = dataclasses.replace(
        options, load_dir=stage_dir(root, engine.stage_id), tag=tag, verify=False
    )

    def load() -> tuple[str | None, dict[str, Any] | None]:
        if sources is None:
            return load_checkpoint(engine, stage)
        return reshape.load_stage(engine, sources, stage)

    # no stage trains on while another has not loaded
    return _on_every_stage(
        engine,
        load,
        lambda failed: (
            f"{where}: stage(s) {failed} failed to load (their error is raised there); this "
            "stage loaded, the pipeline as a whole did not"
        ),
    )


def _load_deepspeed_stages(
    engine: StageEngine, directory: Path, options: LoadOptions, layers: PipelineLayers
) -> tuple[str | None, dict[str, Any] | None]:
    """DeepSpeed's pipeline checkpoint `directory` into this pipeline: every stage reads its
    names from whichever saved stage holds them (see _ds_pipeline.py). A name the checkpoint has
    and no stage of this pipeline has fails the load on every rank (not with
    ``load_module_strict=False``), as a name a stage lacks does there."""
    where = f"load_checkpoint({str(directory)!r})"
    world = _world(engine)
    ck, error = None, None
    try:
        if not is_pipeline(directory):
            raise CheckpointMismatchError(
                f"{directory} was saved by DeepSpeed's engine, not its pipeline engine: load it "
                "into an engine of the same model"
            )
        stage_names = {engine.stage_id: group_names(engine)}
        ck = DeepSpeedPipelineCheckpoint(directory, layers.prefix, stage_names)
    except CheckpointError as exc:
        error = exc
    world.agree(where, error)
    assert ck is not None
    mine = {n for n, _ in engine.module.named_parameters()}
    mine |= {n for n, _ in persistent_buffers(engine.module)}
    pipe = Sync(engine.grid.get_pipe_parallel_group(), engine.config.checkpoint.timeout)
    held = set().union(*pipe.gather(sorted(mine)))
    saved = ck.params.keys() | ck.frozen().keys() | ck.buffers().keys()
    extra = sorted(saved - held - ck.shared().keys())
    if extra and options.load_module_strict:
        raise CheckpointMismatchError(
            f"{where}: DeepSpeed's checkpoint has what no stage of this pipeline has: "
            f"{', '.join(layers.label(n) for n in extra)}"
        )
    return _on_every_stage(
        engine,
        lambda: load_deepspeed(
            engine, engine_sync(engine), directory, options, checkpoint=ck, only=mine
        ),
        lambda failed: (
            f"{where}: stage(s) {failed} failed to load (their error is raised there); this "
            "stage loaded, the pipeline as a whole did not"
        ),
    )


def _verify_stage(engine: StageEngine, root: Path, tag: str, sources: Sources | None) -> None:
    """Every file this stage will read against its CRC: its own directory (`sources` None)
    or its old stages'. Collective over the stage's data-parallel ranks."""
    sync = engine_sync(engine)
    if sources is not None:
        for s in sorted(sources.take):
            verify_files(sync, sources.directories[s], sources.manifests[s])
        return
    directory, manifest, error = root, {}, None
    try:
        directory = files.resolve(stage_dir(root, engine.stage_id), tag)
        manifest = files.read_manifest(directory)
    except CheckpointError as exc:
        error = exc
    sync.agree(f"load_checkpoint({str(directory)!r})", error)
    verify_files(sync, directory, manifest)


def _sources(
    engine: StageEngine, root: Path, tag: str, optimizer: bool, where: str, layers: PipelineLayers
) -> Sources | None:
    """Where this stage loads from: None for its own saved directory (it holds exactly this
    stage's names, or the checkpoint has no layout), else the old stages to read. Collective
    over the world; raises alike on every rank when the checkpoint does not fit the module
    (its `layers`)."""
    world = _world(engine)
    layout, saved, error = None, [], None
    try:
        layout = read_layout(root, tag)
        if layout is not None:
            saved = read_manifests(root, tag, layout.stages)
    except CheckpointError as exc:
        error = exc
    world.agree(where, error)
    if layout is None:
        return None
    mine = stage_description(engine)
    # every stage's description, over this rank's pipeline (one rank per stage: the data-
    # parallel replicas describe the same), not the world: the descriptions can be large
    pipe = Sync(engine.grid.get_pipe_parallel_group(), engine.config.checkpoint.timeout)
    now = sorted(pipe.gather(mine), key=lambda d: int(d["stage"]))
    # the same descriptions and files on every rank: every rank raises alike
    problems = mismatches(
        layout, saved, now, layers=layers.layout.layers, label=layers.label, optimizer=optimizer
    )
    if problems:
        lines = "\n  ".join(problems)
        raise CheckpointMismatchError(
            f"{where}: the checkpoint ({layout.stages} stages, partition {layout.parts}) is "
            f"not of this pipeline's layers; nothing was loaded:\n  {lines}"
        )
    if layout.stages == engine.num_stages and names(saved[engine.stage_id]) == names(mine):
        return None
    log.info(
        "zengine: stage %d of %d loads from a checkpoint of %d stages (partition %s, now %s)",
        engine.stage_id,
        engine.num_stages,
        layout.stages,
        layout.parts,
        layers.layout.parts,
    )
    return reshape.sources(root, tag, saved, names(mine), engine.stage_id, engine.num_stages)
