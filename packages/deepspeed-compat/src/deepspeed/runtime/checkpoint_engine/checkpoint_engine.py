"""``deepspeed.runtime.checkpoint_engine.checkpoint_engine``: DeepSpeed's ``CheckpointEngine``,
the interface its engines write and read checkpoint files through, and ``CheckpointCommitInfo``."""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Any

__all__ = ["CheckpointCommitInfo", "CheckpointEngine"]


@dataclasses.dataclass
class CheckpointCommitInfo:
    """Which checkpoint a `CheckpointEngine.create` / ``commit`` call is about."""

    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(abc.ABC):
    """DeepSpeed's interface: ``create`` a checkpoint, ``save`` and ``load`` its files, then
    ``commit`` it once every file is written. What DeepSpeed's base class does itself
    (``makedirs``, which rank writes, no decoupling) it does here too."""

    def __init__(self, config_params: Any = None) -> None:
        self.name: str | None = None

    @abc.abstractmethod
    def create(self, info: CheckpointCommitInfo) -> None:
        """Start the checkpoint `info` names."""

    @abc.abstractmethod
    def save(self, state_dict: Any, path: str) -> None:
        """Write `state_dict` to the file `path`."""

    @abc.abstractmethod
    def load(self, path: str, map_location: Any = None) -> Any:
        """What `save` wrote to `path`, its tensors on `map_location`."""

    @abc.abstractmethod
    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file of the checkpoint `info` names is written."""

    def makedirs(self, path: str | os.PathLike[str], exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:  # noqa: B027 - optional
        """Where a decoupled engine records what it commits next; nothing here."""

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return None

    def cleanup(self) -> None:  # noqa: B027 - optional, as DeepSpeed's
        """Release what the engine holds; nothing here."""

    def preserves_storage_sharing(self) -> bool:
        return True
