"""``engine.save_checkpoint`` and ``engine.load_checkpoint``, with torch.distributed.checkpoint.

Each rank writes its own pieces in parallel (one file per rank, keyed by parameter name: see
[Note: checkpoints keyed by parameter name]); the directory becomes a checkpoint, and
``latest`` names it, only once every rank's files are on disk (see [Note: a checkpoint is good
or absent]). Both calls are collective: every rank of the data-parallel group must make them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from zengine._checkpoint import _files as files
from zengine._checkpoint._client_state import client_state_problem
from zengine._checkpoint._dcp import save_sharded
from zengine._checkpoint._dcp_read import SafeFileSystemReader, load_entries
from zengine._checkpoint._ds_files import resolve_deepspeed
from zengine._checkpoint._ds_load import load_deepspeed
from zengine._checkpoint._engine_view import CheckpointEngine
from zengine._checkpoint._errors import (
    CheckpointError,
    CheckpointTagError,
    ClientStateError,
    CorruptCheckpointError,
)
from zengine._checkpoint._manifest import check, describe
from zengine._checkpoint._options import LoadOptions, SaveOptions
from zengine._checkpoint._pieces import PieceLoadPlanner
from zengine._checkpoint._recovery import write_recovery_script
from zengine._checkpoint._state import (
    ENGINE,
    after_load,
    apply_engine_state,
    apply_optimizer_objects,
    apply_rng,
    engine_state,
    frozen_shards_in_memory,
    model_entries,
    optimizer_destinations,
    optimizer_entries,
    optimizer_of,
    rank_key,
    rng_state,
)
from zengine._checkpoint._sync import Sync

__all__ = ["load_checkpoint", "save_checkpoint"]

log = logging.getLogger("zengine")

_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def engine_sync(engine: CheckpointEngine) -> Sync:
    """The agreement of the engine's data-parallel group, within the config's timeout."""
    return Sync(engine.group, engine.config.checkpoint.timeout)


def _agreed_tag(
    engine: CheckpointEngine, sync: Sync, save_dir: Any, tag: str, client_state: Any = None
) -> str:
    """The tag every rank saves under: rank 0's. Every rank sees every rank's `save_dir`, tag
    and what is wrong with its `client_state`, so they all raise alike (no directory, as
    DeepSpeed's ValueError; a client state that is not plain data; a tag that is no directory
    name; different tags with ``tag_validation`` FAIL) or go on alike."""
    asked: list[tuple[str | None, str, str | None]] = sync.gather(
        (None if save_dir else repr(save_dir), tag, client_state_problem(client_state))
    )
    no_dir = [f"{empty} on rank {rank}" for rank, (empty, _, _) in enumerate(asked) if empty]
    if no_dir:
        raise ValueError(
            f"save_checkpoint: save_dir must be a non-empty path, got {', '.join(no_dir)} "
            "(use '.' for the current directory)"
        )
    unsafe = [f"rank {rank}: {problem}" for rank, (_, _, problem) in enumerate(asked) if problem]
    if unsafe:
        raise ClientStateError(
            "save_checkpoint: client_state may hold only plain data (None, bool, int, float, "
            "str, bytes, tensors, and lists, tuples and dicts of them), since a checkpoint is "
            "loaded without running code; nothing was saved:\n  " + "\n  ".join(unsafe)
        )
    tags = [t for _, t, _ in asked]
    bad = sorted({t for t in tags if not _TAG.fullmatch(t) or t == files.LATEST})
    if bad:
        raise ValueError(
            f"save_checkpoint: tag {bad[0]!r} is not usable as a directory name (letters, "
            f"digits, '_', '.', '+', '-'; not starting with '.'; not {files.LATEST!r})"
        )
    if len(set(tags)) > 1:
        mode = engine.config.checkpoint.tag_validation
        message = f"save_checkpoint: the ranks passed different tags: {tags}"
        if mode == "FAIL":
            raise CheckpointTagError(message)
        if mode == "WARN":
            log.warning("zengine: %s; saving under rank 0's, %r", message, tags[0])
    return tags[0]


def save_checkpoint(engine: CheckpointEngine, options: SaveOptions) -> bool:
    """Save everything training needs to resume exactly; every rank must call it. With
    ``exclude_frozen_parameters`` the frozen parameters are left out (DeepSpeed's: a PEFT
    adapter's checkpoint without the base model), to be loaded with ``load_module_strict=False``.
    With ``universal``, rank 0 then writes the saved checkpoint as DeepSpeed's universal
    checkpoint in ``save_dir/<tag>_universal`` (and, with ``save_latest``,
    ``save_dir/latest_universal``). Rank 0 writes ``save_dir/zero_to_fp32.py`` as DeepSpeed does
    (see _recovery.py), unless ``recovery_script`` is False (a pipeline's stage: its save_dir is
    not the one users run).

    ``client_state`` (each rank's own) may hold plain data only, since a checkpoint is loaded
    without running code: None, bool, int, float, str, bytes, tensors, ``torch.Size``,
    ``torch.dtype``, ``torch.device``, and lists, tuples and dicts (keys: None, bool, int,
    float, str) of them, exactly those types. Anything else (a sampler, a ``torch.Generator``, a
    NumPy array, a namedtuple) fails the save on every rank before anything is written, with a
    `ClientStateError` naming the rank, where it is (``client_state['sampler']['gen']``) and
    its type (see _client_state.py).

    A ``.partial`` folder in ``save_dir`` that a killed save of ours left (see [Note: a killed
    save's .partial folder]) is removed first, and logged."""
    sync = engine_sync(engine)
    sync.arrive("save_checkpoint")
    optimizer_of(engine).resident()  # offloaded to NVMe (offload_optimizer/param): read it back
    save_dir = options.save_dir
    tag = _agreed_tag(
        engine,
        sync,
        save_dir,
        str(options.tag) if options.tag is not None else f"global_step{engine.global_steps}",
        options.client_state,
    )
    root = Path(save_dir)
    partial = files.partial_dir(root, tag)
    start = time.perf_counter()
    error = None
    if sync.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for folder, writer in files.abandoned_partials(root):
                files.remove_quietly(folder)
                log.warning(
                    "zengine: removed %s, left by a save that did not finish (%s)", folder, writer
                )
            files.remove_quietly(partial)
            files.start_partial(partial)
        except OSError as exc:
            error = f"cannot create {partial}: {exc}"
    sync.agree(f"save_checkpoint({str(root)!r}, tag={tag!r})", error)
    log.info("zengine: saving checkpoint %s to %s", tag, root)
    try:
        _write(engine, sync, partial, root / tag, options)
    except BaseException as exc:
        if sync.rank == 0:
            files.remove_quietly(partial)  # the last good checkpoint and `latest` stay as they were
        if isinstance(exc, CheckpointError):
            sync.gather(None)  # every rank failed here alike: none returns before the cleanup
        raise
    size = sum(f.stat().st_size for f in (root / tag).iterdir())
    log.info(
        "zengine: saved checkpoint %s (%.1f MiB) in %.2f s",
        root / tag,
        size / 2**20,
        time.perf_counter() - start,
    )
    if options.universal:
        _export_universal(sync, root / tag, options.save_latest)
    return True


def _export_universal(sync: Sync, saved: Path, latest: bool) -> None:
    """Rank 0 writes DeepSpeed's universal checkpoint of `saved` beside it; every rank raises
    if that fails (`saved` and ``latest`` stay: the checkpoint itself is good)."""
    from zengine._checkpoint._universal_write import export_universal

    out = saved.with_name(f"{saved.name}_universal")
    error = None
    if sync.rank == 0:
        try:  # its files were checksummed just now: not read twice
            export_universal(saved, out, latest=latest, verify=False)
        except Exception as exc:  # any failure, so that no rank waits for rank 0 in vain
            error = exc
    sync.agree(f"save_checkpoint: DeepSpeed's universal checkpoint {out} (rank 0)", error)


def _write(
    engine: CheckpointEngine, sync: Sync, partial: Path, final: Path, options: SaveOptions
) -> None:
    where = f"save_checkpoint to {final}"
    exclude_frozen = options.exclude_frozen_parameters
    with frozen_shards_in_memory(engine):
        state = {**model_entries(engine, exclude_frozen), **optimizer_entries(engine)}
        state[ENGINE] = engine_state(engine)
        state[rank_key(sync.rank, "rng")] = rng_state()
        state[rank_key(sync.rank, "client_state")] = dict(options.client_state or {})
        save_sharded(state, partial, sync, what=where)
    log.info("zengine: shards written; checksumming")
    mine = {
        f.name: dict(zip(("crc32", "bytes"), files.checksum(f), strict=True), rank=sync.rank)
        for f in files.rank_files(partial, sync.rank)
    }
    written: dict[str, Any] = {}
    for part in sync.gather(mine):
        written.update(part)
    error = None
    if sync.rank == 0:
        try:
            if options.recovery_script:  # first: a save that cannot write it publishes nothing
                write_recovery_script(final.parent)
            _finish(engine, partial, final, written, options)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    sync.agree(f"{where} (manifest, rename and '{files.LATEST}' on rank 0)", error)


def _finish(
    engine: CheckpointEngine,
    partial: Path,
    final: Path,
    written: dict[str, Any],
    options: SaveOptions,
) -> None:
    """Rank 0, once every rank's files are on disk: the manifest, the rename, ``latest``."""
    crc, size = files.checksum(partial / ".metadata")
    written[".metadata"] = {"crc32": crc, "bytes": size, "rank": 0}
    described = describe(engine, options.exclude_frozen_parameters)
    manifest = {**described, "tag": final.name, "files": written}
    files.write_atomic(partial / files.MANIFEST, json.dumps(manifest, indent=1).encode())
    (partial / files.PARTIAL_MARKER).unlink()  # complete: not for a later save to remove
    files.publish(partial, final)
    if options.save_latest:
        files.write_atomic(final.parent / files.LATEST, final.name.encode())


def load_checkpoint(
    engine: CheckpointEngine, options: LoadOptions
) -> tuple[str | None, dict[str, Any] | None]:
    """Load a checkpoint saved at any world size and ZeRO stage, by zstack or by DeepSpeed (its
    own format or a universal one, see `load_deepspeed`); ``(path, client_state)``, or
    ``(None, None)`` when ``load_dir`` holds no ``latest`` and no tag is given (DeepSpeed's).
    ``load_module_strict`` False: parameters and buffers only one side has are skipped (the
    model's keep their values); ``load_module_only``: the weights alone, not the optimizer, the
    schedule, the counters or the RNG (both DeepSpeed's). An engine without an optimizer (forward
    passes only) loads the weights alone, whatever the options say. Without ``verify`` the caller
    has checked the files' CRCs already (a pipeline's stages)."""
    forward_only = engine.optimizer is None
    if options.load_module_only or forward_only:
        options = dataclasses.replace(options, load_optimizer_states=False)
    sync = engine_sync(engine)
    sync.arrive("load_checkpoint")
    if not forward_only:
        optimizer_of(engine).resident()  # the tensors loaded into must be in memory, not on NVMe
    root, tag = Path(options.load_dir), options.tag
    deepspeed = resolve_deepspeed(root, tag, universal=engine.config.checkpoint.load_universal)
    if deepspeed is not None:
        return load_deepspeed(engine, sync, deepspeed, options)
    if tag is None and not (root / files.MANIFEST).exists() and files.read_latest(root) is None:
        log.warning("zengine: no '%s' file in %s: no checkpoint loaded", files.LATEST, root)
        return None, None
    start = time.perf_counter()
    directory, manifest, error = root, {}, None
    try:
        directory = files.resolve(root, tag)
        manifest = files.read_manifest(directory)
        check(
            manifest,
            engine,
            where=str(directory),
            optimizer=options.load_optimizer_states,
            strict=options.load_module_strict,
        )
    except CheckpointError as exc:
        error = exc
    sync.agree("load_checkpoint", error)  # every rank sees the same files, or none goes on
    if options.verify:
        verify_files(sync, directory, manifest)
    log.info("zengine: loading checkpoint %s", directory)
    loaded = _read(engine, sync, directory, manifest, options.load_optimizer_states)
    after_load(engine)
    if options.load_optimizer_states:
        apply_optimizer_objects(engine, loaded)
    src = sync.rank % int(manifest["world_size"])
    if not (options.load_module_only or forward_only):
        scheduler = options.load_lr_scheduler_states
        apply_engine_state(engine, loaded[ENGINE], scheduler=scheduler)
        apply_rng(loaded[rank_key(src, "rng")])
    log.info("zengine: loaded checkpoint %s in %.2f s", directory, time.perf_counter() - start)
    client: dict[str, Any] = loaded[rank_key(src, "client_state")]
    return str(directory), client


def verify_files(sync: Sync, directory: Path, manifest: dict[str, Any]) -> None:
    """Every file against its checksum, each rank checking its share of the files."""
    names = sorted(manifest["files"])
    error = None
    try:
        problems = files.verify(directory, manifest["files"], names[sync.rank :: sync.world])
        error = "; ".join(problems) or None
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    sync.agree(f"load_checkpoint({str(directory)!r})", error, CorruptCheckpointError)


def _read(
    engine: CheckpointEngine, sync: Sync, directory: Path, manifest: dict[str, Any], optimizer: bool
) -> dict[str, Any]:
    src = sync.rank % int(manifest["world_size"])
    extras = [ENGINE, rank_key(src, "rng"), rank_key(src, "client_state")]
    saved = manifest["params"].keys() | manifest["buffers"].keys()

    def in_both(key: str) -> bool:  # the model's entries the checkpoint has (others: all)
        kind, _, name = key.partition("/")
        return kind not in ("master", "model") or name in saved

    masters = {n for n, info in manifest["params"].items() if info["group"] is not None}
    return read_entries(
        engine,
        sync,
        directory,
        optimizer=optimizer,
        extras=extras,
        keep=in_both,
        saved_masters=masters,
    )


def read_entries(
    engine: CheckpointEngine,
    sync: Sync,
    directory: Path,
    *,
    optimizer: bool,
    extras: Iterable[str],
    keep: Callable[[str], bool] | None = None,
    saved_masters: Collection[str] = (),
) -> dict[str, Any]:
    """Read `directory` into this rank's tensors (DCP writes straight into them): every
    entry of the model (and of the optimizer), or those whose key `keep` keeps, and the
    objects `extras` (DCP replaces their values). `saved_masters`: the parameters the
    checkpoint has masters of, which an engine without an optimizer reads its weights from."""
    error: CheckpointError | None = None
    metadata = None
    try:
        metadata = SafeFileSystemReader(directory).read_metadata()
    except CheckpointError as exc:
        error = exc
    where = f"load_checkpoint({str(directory)!r}): reading"
    sync.agree(where, error, CorruptCheckpointError)
    assert metadata is not None
    with frozen_shards_in_memory(engine):  # frozen shards kept as codes or on NVMe
        entries: dict[str, Any] = dict(model_entries(engine, saved_masters=saved_masters))
        if optimizer:  # creates the state the optimizer has not made yet, as the file has it
            entries.update(optimizer_destinations(engine, metadata.state_dict_metadata))
        dest = entries if keep is None else {k: v for k, v in entries.items() if keep(k)}
        for key in extras:
            dest[key] = entries.get(key)
        try:  # each rank reads its own pieces: no collective (see _dcp.py)
            load_entries(dest, directory, PieceLoadPlanner())
        except CheckpointError as exc:
            error = exc
    sync.agree(where, error, CorruptCheckpointError)
    return dest
