"""One stage of a pipeline loaded from a checkpoint saved with other stages or partitions.

Every old stage's directory is an engine checkpoint keyed by parameter name (see
_stage_layout.py). This stage reads, from each old stage that holds some of its names
(the lowest one, for a tied weight held by several), the entries of those names only: a DCP
load reads exactly the keys its destination holds, and reshards each over this stage's
data-parallel ranks as any engine load does. What every stage saves alike (step counters, LR
scheduler, loss scale, the optimizer's group options) and what is per rank (RNG, client state)
comes from one old stage, the *primary*: ``stage * old_stages // stages``, this stage itself
when the stage count is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

from zengine._checkpoint._engine_view import StageEngine
from zengine._checkpoint._options import LoadOptions
from zengine._checkpoint._save_load import engine_sync, read_entries, verify_files
from zengine._checkpoint._stage_layout import owners, stage_dir
from zengine._checkpoint._state import (
    ENGINE,
    PARAM_GROUPS,
    after_load,
    apply_engine_state,
    apply_optimizer_objects,
    apply_rng,
    optimizer_of,
    rank_key,
)

__all__ = ["Sources", "load_stage", "sources"]

log = logging.getLogger("zengine")


@dataclasses.dataclass(frozen=True)
class Sources:
    """Where one stage's state comes from."""

    directories: dict[int, Path]  # old stage -> its checkpoint directory, for those read
    manifests: dict[int, dict[str, Any]]
    take: dict[int, set[str]]  # old stage -> the names this stage reads from it
    primary: int


def sources(
    root: Path, tag: str, saved: list[dict[str, Any]], mine: set[str], stage: int, stages: int
) -> Sources:
    """The old stages that `stage` of `stages` reads its names `mine` from (every name is in
    the checkpoint: the layers were checked first)."""
    owner = owners(saved)
    primary = stage * len(saved) // stages
    take: dict[int, set[str]] = {primary: set()}
    for name in mine:
        take.setdefault(owner[name], set()).add(name)
    return Sources(
        {s: stage_dir(root, s) / tag for s in take},
        {s: saved[s] for s in take},
        take,
        primary,
    )


def _takes(names: set[str], key: str) -> bool:
    """Whether the state key `key` is of one of `names`."""
    return _name_of(key) in names


def _name_of(key: str) -> str:
    """The parameter or buffer a state key belongs to (see _state.py):
    ``master/<name>``, ``model/<name>``, ``optim/<name>/<state>``; "" for other keys."""
    kind, _, rest = key.partition("/")
    if kind == "optim":
        return rest.rpartition("/")[0]
    return rest if kind in ("master", "model") else ""


def load_stage(
    engine: StageEngine, src: Sources, options: LoadOptions
) -> tuple[str, dict[str, Any]]:
    """Load this stage from the old stages in `src`, as `options` say (their directory and tag
    are resolved into `src` already); ``(path, client_state)`` as ``engine.load_checkpoint``
    returns, the path the primary's directory. Without ``options.verify`` the caller has
    checked the files' CRCs already."""
    optimizer = options.load_optimizer_states
    sync = engine_sync(engine)
    sync.arrive("load_checkpoint")
    optimizer_of(engine).resident()  # the tensors loaded into must be in memory, not on NVMe
    start = time.perf_counter()
    for s in sorted(src.take) if options.verify else ():  # every file read is checked first
        verify_files(sync, src.directories[s], src.manifests[s])
    rank = sync.rank % int(src.manifests[src.primary]["world_size"])
    extras = [ENGINE, rank_key(rank, "rng"), rank_key(rank, "client_state")]
    if optimizer:
        extras.append(PARAM_GROUPS)
    loaded: dict[str, Any] = {}
    for s in sorted(src.take):
        log.info(
            "zengine: stage %d loading %d names from %s",
            engine.stage_id,
            len(src.take[s]),
            src.directories[s],
        )
        # the entries of the names it takes, and from the primary the objects `extras`
        mine = extras if s == src.primary else []
        keep = functools.partial(_takes, src.take[s])
        directory = src.directories[s]
        loaded.update(
            read_entries(engine, sync, directory, optimizer=optimizer, extras=mine, keep=keep)
        )
    after_load(engine)
    if optimizer:
        apply_optimizer_objects(engine, loaded)
    apply_engine_state(engine, loaded[ENGINE], scheduler=options.load_lr_scheduler_states)
    apply_rng(loaded[rank_key(rank, "rng")])
    log.info(
        "zengine: stage %d loaded from %d saved stage(s) in %.2f s",
        engine.stage_id,
        len(src.take),
        time.perf_counter() - start,
    )
    client: dict[str, Any] = loaded[rank_key(rank, "client_state")]
    return str(src.directories[src.primary]), client
