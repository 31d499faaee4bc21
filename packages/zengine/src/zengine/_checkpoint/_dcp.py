"""A torch.distributed.checkpoint save whose every step the ranks agree on.

``dcp.save`` runs DCP's save protocol (local plans, one global plan, each rank writes, the
coordinator writes ``.metadata``) through ``all_gather_object`` and friends, which need NumPy on
CPU, and it reports a failed write only as an exception that is not an ``Exception``. This runs
the same protocol, through the storage writer's and planner's public interfaces, with `Sync`:
every rank computes the global plan from all the local plans (it is deterministic), writes its
files, and the coordinator writes ``.metadata`` only once every rank says its writes succeeded;
any rank's failure becomes one error, on every rank, naming the rank and what failed.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from zengine._checkpoint._errors import CheckpointError
from zengine._checkpoint._pieces import PieceSavePlanner
from zengine._checkpoint._sync import Sync

__all__ = ["save_sharded"]


def _error(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno})"


def save_sharded(state: dict[str, Any], directory: Path, sync: Sync, *, what: str) -> None:
    """Write `state` (values: tensors, `Piece`s, objects) as a DCP checkpoint in `directory`;
    `CheckpointError` on every rank when any rank fails."""
    planner = PieceSavePlanner()
    writer = FileSystemWriter(directory, sync_files=True)
    coordinator = sync.rank == 0
    local: SavePlan | None = None
    error = None
    try:
        planner.set_up_planner(
            state, storage_meta=writer.storage_meta(), is_coordinator=coordinator
        )
        writer.set_up_storage_writer(coordinator, rank=sync.rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as exc:
        error = _error(exc)
    plans = sync.gather((local, error))
    sync.agree(f"{what}: planning", error)
    plans_, metadata = planner.create_global_plan([plan for plan, _ in plans])
    final = planner.finish_plan(writer.prepare_global_plan(plans_)[sync.rank])
    results: list[WriteResult] = []
    try:
        future = writer.write_data(final, planner)
        future.wait()
        results = future.value()
    except Exception as exc:
        error = _error(exc)
    gathered = sync.gather((results, error))
    sync.agree(f"{what}: writing this rank's shards", error)
    if coordinator:
        try:
            writer.finish(metadata=metadata, results=[r for r, _ in gathered])
        except Exception as exc:
            error = _error(exc)
    sync.agree(f"{what}: writing .metadata", error, CheckpointError)
