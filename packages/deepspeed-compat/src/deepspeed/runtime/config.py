"""``deepspeed.runtime.config``: DeepSpeed's ``DeepSpeedConfig`` over zengine's config reader
(`zengine.load_config`: the same keys, defaults and errors), read under DeepSpeed's attribute
names, and DeepSpeed's names of its optimizers (``ADAM_OPTIMIZER``, ...)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

import torch

import zcomm
import zengine.config
from zengine.config import BF16Config, EngineConfig, FP16Config, ZeroConfig

__all__ = [
    "ADAGRAD_OPTIMIZER",
    "ADAMW_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "DEEPSPEED_OPTIMIZERS",
    "LION_OPTIMIZER",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
]

DeepSpeedConfigError = zengine.ConfigError

# DeepSpeed's names of the optimizers a config's "optimizer": {"type": ...} builds (any case)
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LION_OPTIMIZER = "lion"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LION_OPTIMIZER]


class _ModelParallelUnit(Protocol):
    def get_data_parallel_world_size(self) -> int: ...


class DeepSpeedConfig:
    """A DeepSpeed config (a dict, or a JSON or HJSON file's path), validated by zengine and
    read under DeepSpeed's attribute names: ``zero_config``, ``bfloat16_config``,
    ``gradient_allreduce_op``, ...

    The batch sizes are resolved against the data-parallel size (`mpu`'s, `mesh_device`'s
    ``"data_parallel"`` group, or the world), and stay plain attributes, as DeepSpeed's: a
    caller may change them and call `_configure_train_batch_size` to derive the missing ones
    again. A bad config raises ``DeepSpeedConfigError`` (a ``ValueError``) naming each key.
    """

    def __init__(
        self,
        config: Mapping[str, Any] | str | os.PathLike[str],
        mpu: _ModelParallelUnit | None = None,
        mesh_device: Any = None,
    ) -> None:
        # DeepSpeed's: the config as given, which its callers read keys of
        self._param_dict: dict[str, Any] = zengine.config.read_config(config)
        self.global_rank = zcomm.get_rank() if zcomm.is_initialized() else 0
        self.world_size = _data_parallel_size(mpu, mesh_device)
        self._config: EngineConfig = zengine.load_config(
            self._param_dict, world_size=self.world_size
        )
        self.train_batch_size: int | None = self._config.train_batch_size
        self.train_micro_batch_size_per_gpu: int | None = (
            self._config.train_micro_batch_size_per_gpu
        )
        self.gradient_accumulation_steps: int | None = self._config.gradient_accumulation_steps

    def _configure_train_batch_size(self) -> None:
        """Derive the batch sizes set to None from the others, as the config's are derived.

        Raises:
            AssertionError: sizes that do not add up, or too few of them (DeepSpeed asserts
                here, and its callers catch that), with zengine's message naming the keys.
        """
        try:
            sizes = zengine.config.resolve_batch_sizes(
                self.train_batch_size,
                self.train_micro_batch_size_per_gpu,
                self.gradient_accumulation_steps,
                world_size=self.world_size,
            )
        except zengine.ConfigError as error:
            raise AssertionError(str(error)) from None
        (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        ) = sizes

    # -- the sections, as DeepSpeed names them ----------------------------------------------

    @property
    def zero_config(self) -> ZeroConfig:
        return self._config.zero_optimization

    @property
    def zero_optimization_stage(self) -> int:
        return self._config.zero_stage

    @property
    def zero_enabled(self) -> bool:
        return self._config.zero_stage > 0

    @property
    def float16_config(self) -> FP16Config:
        return self._config.fp16

    @property
    def bfloat16_config(self) -> BF16Config:
        return self._config.bf16

    # -- top-level keys ---------------------------------------------------------------------

    @property
    def steps_per_print(self) -> int | float:
        return self._config.steps_per_print

    @property
    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    @property
    def gradient_allreduce_op(self) -> str:
        return self._config.gradient_allreduce_op

    @property
    def prescale_gradients(self) -> bool:
        return self._config.prescale_gradients

    @property
    def gradient_predivide_factor(self) -> float:
        return self._config.gradient_predivide_factor

    @property
    def communication_data_type(self) -> torch.dtype | None:
        return self._config.communication_dtype

    @property
    def grad_accum_dtype(self) -> str | None:
        return self._config.gradient_accumulation_dtype

    @property
    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    @property
    def dataloader_drop_last(self) -> bool:
        return self._config.dataloader_drop_last

    @property
    def zero_allow_untested_optimizer(self) -> bool:
        return self._config.zero_allow_untested_optimizer

    @property
    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self._config.zero_force_ds_cpu_optimizer

    @property
    def optimizer_name(self) -> str | None:
        """The optimizer's type in DeepSpeed's lower case (``"adam"``); None without one."""
        optimizer = self._config.optimizer
        return None if optimizer is None else optimizer.type.lower()

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        optimizer = self._config.optimizer
        return None if optimizer is None else dict(optimizer.params)

    @property
    def scheduler_name(self) -> str | None:
        scheduler = self._config.scheduler
        return None if scheduler is None else scheduler.type

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        scheduler = self._config.scheduler
        return None if scheduler is None else dict(scheduler.params)

    @property
    def checkpoint_tag_validation_enabled(self) -> bool:
        return self._config.checkpoint.tag_validation != "IGNORE"

    @property
    def checkpoint_tag_validation_fail(self) -> bool:
        return self._config.checkpoint.tag_validation == "FAIL"

    @property
    def load_universal_checkpoint(self) -> bool:
        return self._config.checkpoint.load_universal

    @property
    def torch_autocast_enabled(self) -> bool:
        return self._config.torch_autocast.enabled

    @property
    def torch_autocast_dtype(self) -> str | None:
        return self._config.torch_autocast.dtype


def _data_parallel_size(mpu: _ModelParallelUnit | None, mesh_device: Any) -> int:
    """The ranks the batch is split over: DeepSpeed's choice of `mpu`, the mesh's
    ``"data_parallel"`` axis, or every rank (one when torch.distributed is not started)."""
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    if mesh_device is not None:
        return zcomm.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
    return zcomm.get_world_size() if zcomm.is_initialized() else 1
