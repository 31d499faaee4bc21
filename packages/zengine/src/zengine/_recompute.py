"""Activation checkpointing (recomputation) for a model's own blocks: what the public
``zengine.checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``) holds. Named for what it does,
apart from ``_checkpoint/``, which saves and loads training state.

``checkpoint(function, *args, **kwargs)`` keeps none of `function`'s activations: its forward
runs again in backward. torch's non-reentrant checkpoint is underneath, so it composes with
ZeRO-3's hooks (the recomputation gathers its parameters again), ``torch.autocast`` and
``torch.compile``, restores the RNG states (dropout draws the same masks), and takes keyword
arguments and outputs of any structure. ``reentrant_checkpoint(function, *args)`` is torch's
reentrant checkpoint (what DeepSpeed's ``checkpoint`` is), the default of a
``PipelineModule`` (``pipeline.use_reentrant``). ``configure()`` sets, for both, as
DeepSpeed's does (its arguments first, then the ``activation_checkpointing`` section of
`deepspeed_config`: a dict, a JSON path, or an engine's ``engine.config``):

- ``checkpoint_in_cpu`` (``cpu_checkpointing``): the floating-point inputs a checkpoint keeps
  for its recomputation wait in host memory, so between its forward and its backward a
  checkpointed block holds nothing on the accelerator;
- ``synchronize`` (``synchronize_checkpoint_boundary``): the accelerator is synchronized when
  each checkpointed call starts and ends (the forward and its recomputation);
- ``profile``: the time of each checkpointed call, logged;
- ``partition_activations``, ``contiguous_checkpointing`` (``contiguous_memory_optimization``)
  and ``num_checkpoints`` (``number_checkpoints``): DeepSpeed splits the kept inputs over the
  model-parallel ranks. zstack has no model parallelism: with no mpu, or a model-parallel group
  of one rank, there is nothing to split and they change nothing; an mpu of more ranks is
  refused rather than ignored.

The engine does not read the config section itself, as DeepSpeed's does not: a model calls
``configure(None, deepspeed_config=...)`` to take it. ``engine.config`` is accepted as DeepSpeed
scripts pass it, but it holds no such section (the engine sets it aside, with a warning when
it asks for anything): pass the dict or the path to have the section read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch.utils import checkpoint as torch_checkpoint

import zcomm
from zengine._config import ConfigError, Flag, Section, describe_validation_error, read_config

__all__ = [
    "checkpoint",
    "configure",
    "is_configured",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reentrant_checkpoint",
    "reset",
    "set_num_layers",
]

log = logging.getLogger("zengine.checkpointing")


class ActivationCheckpointingConfig(Section):
    """DeepSpeed's ``activation_checkpointing`` section."""

    partition_activations: Flag = False
    contiguous_memory_optimization: Flag = False
    cpu_checkpointing: Flag = False
    number_checkpoints: int | None = Field(default=None, ge=1)
    synchronize_checkpoint_boundary: Flag = False
    profile: Flag = False


class _Sections(BaseModel):
    # the rest of a DeepSpeed config is the engine's to check
    model_config = ConfigDict(extra="ignore", frozen=True)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )


@dataclasses.dataclass
class _Settings:
    configured: bool = False
    partition: bool = False
    contiguous: bool = False
    num_layers: int | None = None
    cpu: bool = False
    synchronize: bool = False
    profile: bool = False


_settings = _Settings()


def configure(
    mpu_: Any = None,
    deepspeed_config: Mapping[str, Any] | str | os.PathLike[str] | BaseModel | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set how `checkpoint` works (DeepSpeed's signature; the arguments given override
    `deepspeed_config`'s ``activation_checkpointing`` section: of a dict, a JSON path or an
    engine's ``engine.config``)."""
    section = _section(deepspeed_config)
    given = _Settings(
        configured=True,
        partition=section.partition_activations,
        contiguous=section.contiguous_memory_optimization,
        num_layers=section.number_checkpoints,
        cpu=section.cpu_checkpointing,
        synchronize=section.synchronize_checkpoint_boundary,
        profile=section.profile,
    )
    overrides: dict[str, Any] = {
        "partition": partition_activations,
        "contiguous": contiguous_checkpointing,
        "num_layers": num_checkpoints,
        "cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    given = dataclasses.replace(given, **{k: v for k, v in overrides.items() if v is not None})
    if given.contiguous and not given.partition:
        raise ValueError(
            "checkpointing.configure: contiguous_checkpointing needs partition_activations "
            "(DeepSpeed's rule)"
        )
    if given.contiguous and given.num_layers is None:
        raise ValueError(
            "checkpointing.configure: contiguous_checkpointing needs num_checkpoints, the "
            "number of layers checkpointed"
        )
    size = _model_parallel_size(mpu_)
    if given.partition and size > 1:
        raise ValueError(
            f"checkpointing.configure: partition_activations over a model-parallel group of "
            f"{size} ranks: zstack has no model parallelism to split activations over; set "
            "partition_activations false"
        )
    global _settings
    _settings = given


def _section(
    config: Mapping[str, Any] | str | os.PathLike[str] | BaseModel | None,
) -> ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section of a DeepSpeed config: a dict, a JSON path, or
    a validated config object (``engine.config``; DeepSpeed scripts pass the engine's on)."""
    if config is None:
        return ActivationCheckpointingConfig()
    if isinstance(config, BaseModel):
        return _section_of(config)
    try:
        return _Sections.model_validate(read_config(config)).activation_checkpointing
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, _Sections)) from None


def _section_of(config: BaseModel) -> ActivationCheckpointingConfig:
    """The section of a validated config, read as DeepSpeed code reads a config dict (zengine's
    sections answer ``get``). An engine's config holds none: initialize set the section aside,
    with a warning when it asked for anything, so the defaults and the arguments rule."""
    getter = getattr(config, "get", None)
    found = getter("activation_checkpointing") if callable(getter) else None
    if found is None:
        return ActivationCheckpointingConfig()
    if isinstance(found, ActivationCheckpointingConfig):
        return found
    if isinstance(found, BaseModel):
        found = found.model_dump()
    return _section({"activation_checkpointing": found})


def _model_parallel_size(mpu: Any) -> int:
    """The model-parallel size an mpu reports (Megatron's tensor-parallel names first)."""
    if mpu is None:
        return 1
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


def is_configured() -> bool:
    """Whether `configure` was called."""
    return _settings.configured


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's: the number of checkpointed layers (for contiguous buffers; nothing else)."""
    _settings.num_layers = nlayers


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's switch for `partition_activations` (nothing to split without model
    parallelism: see the module's note)."""
    _settings.partition = partition_activation


def reset() -> None:
    """DeepSpeed's: frees contiguous checkpoint buffers between evaluation forwards. zengine
    keeps none: the kept inputs go with the graph that holds them."""


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, keeping none of its activations: it runs again in backward.
    With ``checkpoint_in_cpu`` its floating-point positional inputs are kept in host memory."""
    run, args, timed = _configured(function, args)
    # torch stops a recomputation once it has what backward needs, by raising out of the
    # function: a timed one runs to its end, where its time is taken
    with torch_checkpoint.set_checkpoint_early_stop(not timed):
        return torch_checkpoint.checkpoint(
            run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
        )


non_reentrant_checkpoint = checkpoint
"""DeepSpeed's name for its non-reentrant variant; `checkpoint` is non-reentrant already."""


def reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` under torch's reentrant checkpoint (DeepSpeed's ``checkpoint``): the
    backward of its outputs runs the forward again and a backward inside it. It backs a
    ``PipelineModule``'s checkpointing with ``pipeline.use_reentrant`` true; `configure`'s
    settings apply as to `checkpoint`.

    Gradients reach only the tensors among `args` themselves (not tensors nested in them), and
    none where no input requires grad: there the call is `checkpoint`'s instead, which gives
    the weights inside the same gradients as no checkpoint (a reentrant one would leave them
    None; DeepSpeed avoids it by not checkpointing a GPT pipeline's embedding)."""
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return checkpoint(function, *args)
    run, args, _ = _configured(function, args)
    return torch_checkpoint.checkpoint(run, *args, use_reentrant=True, preserve_rng_state=True)


def _configured(
    function: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], tuple[Any, ...], bool]:
    """`function` and `args` as `configure`'s settings have them run (timed, inputs on the
    host), and whether the run is timed."""
    settings = _settings
    run = function
    timed = settings.synchronize or settings.profile
    if timed:
        run = _timed(function, settings)
    if settings.cpu:
        run, args = _inputs_on_host(run, args)
    return run, args, timed


def _inputs_on_host(
    function: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`function` taking host copies of the floating-point tensors among `args` (what the
    checkpoint keeps), moving them back to where they were when it runs. The copies are
    differentiable: gradients reach the originals through them."""
    devices = [a.device if _offloadable(a) else None for a in args]
    moved = tuple(a.to("cpu") if d is not None else a for a, d in zip(args, devices, strict=True))

    def on_device(*inputs: Any, **kwargs: Any) -> Any:
        back = (
            x.to(d, non_blocking=True) if d is not None else x
            for x, d in zip(inputs, devices, strict=True)
        )
        return function(*back, **kwargs)

    return on_device, moved


def _offloadable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _timed(function: Callable[..., Any], settings: _Settings) -> Callable[..., Any]:
    """`function` with the accelerator synchronized around it (``synchronize``) and its time
    logged (``profile``): its first call is the forward, the next ones its recomputation."""
    accelerator = zcomm.get_accelerator()
    calls = 0

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        accelerator.synchronize()
        start = time.perf_counter()
        out = function(*args, **kwargs)
        accelerator.synchronize()
        if settings.profile:
            log.info(
                "checkpointing: %s of %s took %.3f ms",
                "recomputation" if calls else "forward",
                getattr(function, "__name__", type(function).__name__),
                (time.perf_counter() - start) * 1e3,
            )
        calls += 1
        return out

    return run
