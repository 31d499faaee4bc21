"""What the checkpoint package reads and writes of an engine, declared here.

_checkpoint sits below the engine, its optimizer and the pipeline (the layers in
pyproject.toml's ``[tool.importlinter]``): it imports none of them, not even for a type.
These Protocols name what it uses of them, under the engine's own attribute names;
`zengine.Engine` with its `ZeroOptimizer`, and the pipeline engine, satisfy them structurally
(mypy checks the types where an engine hands itself to a checkpoint function; that nothing
is missing, a test checks with ``isinstance``, since `Engine` hands a name it lacks to its
module). A test may pass a small object with these attributes instead of a whole engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

import zpartition
from zengine._config import EngineConfig

__all__ = [
    "CheckpointEngine",
    "CheckpointOptimizer",
    "Fragment",
    "Layout",
    "Partitions",
    "PipeGrid",
    "StageEngine",
    "Stateful",
]


class Fragment(Protocol):
    """This rank's piece of one parameter in the optimizer's flat partitions."""

    @property
    def numel(self) -> int: ...  # elements on this rank
    @property
    def param_offset(self) -> int: ...  # where the piece starts in the flattened parameter


class Partitions(Protocol):
    """The fp32 masters and where each parameter's piece lies in them."""

    @property
    def fragments(self) -> Mapping[int, Fragment]: ...  # id(param) -> its piece

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None: ...
    def state_key(self, param: torch.Tensor) -> tuple[torch.Tensor, int] | None: ...


class Layout(Protocol):
    """The optimizer's parameter groups and the copy of the masters into the parameters."""

    @property
    def params(self) -> Sequence[Sequence[nn.Parameter]]: ...

    def write_back(self, params: Sequence[nn.Parameter] | None = None) -> None: ...


class Stateful(Protocol):
    """A loss scaler or an LR scheduler: its state saved and restored."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class CheckpointOptimizer(Protocol):
    """``engine.optimizer``: the ZeRO optimizer whose masters and state are saved."""

    skipped_steps: int  # restored on load

    @property
    def partitions(self) -> Partitions: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def shard_group(self) -> dist.ProcessGroup | None: ...  # a shard's index is its rank here
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...  # the torch optimizer: its state
    @property
    def loss_scaler(self) -> Stateful | None: ...
    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def resident(self) -> object: ...  # the state in memory (read back from NVMe)
    def clear_grads(self) -> None: ...


@runtime_checkable
class CheckpointEngine(Protocol):
    """An engine, as a checkpoint saves and loads it; the counters are written on load."""

    global_steps: int
    global_samples: int
    micro_steps: int

    @property
    def module(self) -> nn.Module: ...
    @property
    def optimizer(self) -> CheckpointOptimizer | None: ...  # None: forward passes only
    @property
    def lr_scheduler(self) -> Stateful | None: ...
    @property
    def group(self) -> dist.ProcessGroup | None: ...  # the data-parallel group
    @property
    def config(self) -> EngineConfig: ...
    @property
    def partitioned(self) -> zpartition.Partitioned | None: ...  # stage 3's handle

    def zero_optimization_stage(self) -> int: ...
    def gradient_accumulation_steps(self) -> int: ...


class PipeGrid(Protocol):
    """A pipeline's process groups, as far as a stage's checkpoint gathers over them."""

    def get_pipe_parallel_group(self) -> dist.ProcessGroup: ...


@runtime_checkable
class StageEngine(CheckpointEngine, Protocol):
    """One stage of a pipeline engine (a checkpoint in stages, _stages.py)."""

    @property
    def stage_id(self) -> int: ...
    @property
    def num_stages(self) -> int: ...
    @property
    def grid(self) -> PipeGrid: ...
