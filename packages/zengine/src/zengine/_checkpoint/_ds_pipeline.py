"""A checkpoint DeepSpeed's pipeline engine saved, read by parameter name.

DeepSpeed's ``PipelineEngine`` saves each layer's state dict once, ``layer_<i>-model_states.pt``
(its weights in the compute dtype and buffers), and per stage s what a ZeRO engine saves with
``mp_rank`` s: ``mp_rank_<s>_model_states.pt`` (counters, scheduler, client state, the stage's
parameter shapes; no module) and ``zero_pp_rank_<r>_mp_rank_<s>_optim_states.pt`` (ZeRO-1's
partitions of the stage's masters and optimizer state). Parameters are named as the
``PipelineModule`` names them, by global layer index (``3.up.weight``) or by tie key
(``tied_modules.embed.weight``, held by each stage that runs the tied layer), so a name means
one parameter whatever the stages: each stage of a zstack pipeline reads its own names from
whichever saved stage holds them, with as many stages and data-parallel ranks as it likes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from zengine._checkpoint import _ds_files as ds_files
from zengine._checkpoint._ds_checkpoint import DeepSpeedCheckpoint, read_key

__all__ = ["DeepSpeedPipelineCheckpoint", "is_pipeline"]


def is_pipeline(directory: Path) -> bool:
    """Whether DeepSpeed's pipeline engine saved `directory` (it has layer files)."""
    return bool(ds_files.pipeline_layer_files(directory))


class DeepSpeedPipelineCheckpoint:
    """Every stage of a DeepSpeed pipeline checkpoint, merged by parameter name.

    `prefix` gives the name prefix of a global layer index as the loading ``PipelineModule``
    names it (``"3."``, or ``"tied_modules.embed."`` for a tied layer). `group_names`, per saved
    stage: the optimizer groups' parameter names, which a ZeRO-0 save does not record (a stage
    of the same partition knows them)."""

    def __init__(
        self,
        directory: Path,
        prefix: Callable[[int], str],
        group_names: Mapping[int, Sequence[Sequence[str]]] | None = None,
    ) -> None:
        self.directory = directory
        self.universal = False
        module: dict[str, torch.Tensor] = {}
        for index, paths in ds_files.pipeline_layer_files(directory).items():
            state = ds_files.load_deepspeed_file(paths[0])
            module.update({prefix(index) + key: value for key, value in state.items()})
        self.stages = [
            DeepSpeedCheckpoint(directory, (group_names or {}).get(s, ()), mp_rank=s, module=module)
            for s in range(ds_files.model_parallel_ranks(directory))
        ]
        first = self.stages[0]
        self.model_states = first.model_states
        self.zero_stage = first.zero_stage
        self.world_size = first.world_size
        self._owner: dict[str, DeepSpeedCheckpoint] = {}
        for stage in self.stages:
            for name in stage.params:
                self._owner.setdefault(name, stage)  # a tied layer's copies are equal
        self.params = {name: ck.params[name] for name, ck in self._owner.items()}

    def read(
        self, name: str, kind: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._owner[name].read(name, kind, start, stop, out)

    def read_key(
        self, key: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        return read_key(self, key, start, stop, out)

    def step_of(self, name: str) -> int | None:
        return self._owner[name].step_of(name)

    def buffers(self) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            merged.update(stage.buffers())
        return merged

    def frozen(self) -> dict[str, tuple[int, ...]]:
        """What no stage trains and is no buffer (a stage alone takes the other stages'
        parameters and buffers for frozen parameters)."""
        merged: dict[str, tuple[int, ...]] = {}
        for stage in self.stages:
            merged.update(stage.frozen())
        taken = self.params.keys() | self.buffers().keys()
        return {n: s for n, s in merged.items() if n not in taken}

    def frozen_tensor(self, name: str) -> torch.Tensor:
        return next(s for s in self.stages if name in s.frozen()).frozen_tensor(name)

    def shared(self) -> dict[str, str]:
        return {k: v for stage in self.stages for k, v in stage.shared().items()}

    def module_tensor(self, name: str) -> torch.Tensor | None:
        return self.stages[0].module_tensor(name)

    def state_kinds(self) -> list[str]:
        return self.stages[0].state_kinds()

    def param_groups(self) -> list[dict[str, Any]]:
        return self.stages[0].param_groups()

    def loss_scaler(self) -> dict[str, Any] | None:
        return self.stages[0].loss_scaler()

    def client_state(self) -> dict[str, Any]:
        return self.stages[0].client_state()

    def counters(self) -> dict[str, int]:
        return self.stages[0].counters()
