"""``deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine``: DeepSpeed's engine that writes
with ``torch.save`` and reads with ``torch.load``; reads here are ``weights_only`` (tensors,
containers and plain values: a file cannot run code when it is loaded)."""

from __future__ import annotations

from typing import Any

import torch

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

__all__ = ["TorchCheckpointEngine"]

ENGINE_NAME = "TorchCheckpointEngine"


class TorchCheckpointEngine(CheckpointEngine):
    """``torch.save`` / ``torch.load(weights_only=True)`` behind DeepSpeed's interface.

    Unlike DeepSpeed's, a load refuses pickled objects other than tensors, containers and plain
    values (DeepSpeed loads with ``weights_only=False``), and files are written in torch's
    default (zip) format whatever `config_params` says.
    """

    def __init__(self, config_params: Any = None) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME

    def create(self, info: CheckpointCommitInfo) -> None:
        """Nothing to prepare: each file is written whole by `save`."""

    def save(self, state_dict: Any, path: str) -> None:
        torch.save(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=True)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file is complete once `save` returns."""
        return True
