"""What the checkpoint package reads of an engine (_checkpoint/_engine_view.py), and what
offload_states does (_offload/_states.py): a real engine, its optimizer and a pipeline's stage
have it all, and the manifest's checks run against a small
object of those attributes, without an engine."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

import zpartition
from zcomm.testing import DistributedTest
from zengine._checkpoint import CheckpointMismatchError
from zengine._checkpoint._engine_view import (
    CheckpointEngine,
    CheckpointOptimizer,
    StageEngine,
    Stateful,
)
from zengine._checkpoint._manifest import check, describe
from zengine._config import EngineConfig, load_config
from zengine._offload import StatesEngine, StatesOptimizer
from zengine._progress import Stepping

from ._helpers import checkpoint_engine, pipe_config, pipe_initialize, pipeline


@dataclasses.dataclass
class _Model:
    """An engine as a checkpoint sees it, without an optimizer (forward passes only): the
    manifest describes and checks its module alone."""

    module: nn.Module
    config: EngineConfig
    optimizer: CheckpointOptimizer | None = None
    lr_scheduler: Stateful | None = None
    group: torch.distributed.ProcessGroup | None = None
    partitioned: zpartition.Partitioned | None = None
    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0

    def zero_optimization_stage(self) -> int:
        return 0

    def gradient_accumulation_steps(self) -> int:
        return 1


def _model(hidden: int = 4, *, bias: bool = True) -> _Model:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, hidden, bias=bias), nn.BatchNorm1d(hidden))
    return _Model(module, load_config({"train_batch_size": 1}, world_size=1))


class TestEngineView(DistributedTest):
    world_size = 1

    def test_engines_have_what_checkpoints_read(self) -> None:
        """mypy checks the types of what an engine has, but not that it has it: `Engine`
        hands a name it lacks to its module (``__getattr__``), so a member the Protocols add
        and the engine lacks would pass it."""
        engine = checkpoint_engine(3)
        assert isinstance(engine, CheckpointEngine)
        assert isinstance(engine.optimizer, CheckpointOptimizer)
        assert isinstance(engine, Stepping)  # the progress line's view
        assert isinstance(engine, StatesEngine)  # offload_states' view
        assert isinstance(engine.optimizer, StatesOptimizer)
        stage = pipe_initialize(pipeline(1), pipe_config(zero_optimization={"stage": 1}))
        assert isinstance(stage, StageEngine)
        assert isinstance(stage.optimizer, CheckpointOptimizer)
        assert isinstance(stage, StatesEngine)
        assert not isinstance(engine, StageEngine)  # no stage_id, num_stages, grid
        assert isinstance(_model(), CheckpointEngine)

    def test_manifest_names_what_differs(self) -> None:
        saved = describe(_model())
        check(saved, _model(), where="ckpt", optimizer=False)  # the same model: no error
        with pytest.raises(CheckpointMismatchError) as info:
            check(saved, _model(hidden=5, bias=False), where="ckpt", optimizer=False)
        message = str(info.value)
        assert message.startswith("ckpt is not a checkpoint of this model and config:")
        assert "parameters in the checkpoint but not in the model: 0.bias" in message
        assert "shapes differ (checkpoint vs model): 0.weight (4, 3) vs (5, 3)" in message
        # not strict: what one side lacks is logged and the rest loads; a shape is still wrong
        warned: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("zengine").addHandler(handler)  # it does not propagate (_progress.py)
        try:
            check(saved, _model(bias=False), where="ckpt", optimizer=False, strict=False)
        finally:
            logging.getLogger("zengine").removeHandler(handler)
        assert warned == [
            "zengine: ckpt: loading what both have; parameters in the checkpoint but not in the "
            "model: 0.bias"
        ]
