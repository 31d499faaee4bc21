"""The three batch sizes, resolved as DeepSpeed resolves them.

``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world
size``: of the three, those not given are derived from the others (an accumulation of 1 when
two are missing), and a set that does not add up is a problem naming the keys and the sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zengine._config._errors import ConfigError

__all__ = ["resolve_batch", "resolve_batch_sizes"]

_TRAIN, _MICRO, _ACCUMULATION = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)


def resolve_batch_sizes(
    train_batch_size: int | None,
    train_micro_batch_size_per_gpu: int | None,
    gradient_accumulation_steps: int | None,
    *,
    world_size: int,
) -> tuple[int, int, int]:
    """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``
    with those given as None derived from the others over `world_size` data-parallel ranks, as
    `load_config` resolves a config's (DeepSpeed's ``_configure_train_batch_size``).

    Raises:
        ConfigError: a size that is not a positive int, too few given, or sizes that do not
            add up, each naming the keys.
    """
    given = {
        _TRAIN: train_batch_size,
        _MICRO: train_micro_batch_size_per_gpu,
        _ACCUMULATION: gradient_accumulation_steps,
    }
    bad = [
        f"{key}: expected a positive integer, got {value!r}"
        for key, value in given.items()
        if value is not None
        and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
    ]
    batch, problems = (None, bad) if bad else resolve_batch(given, world_size)
    if batch is None:
        raise ConfigError(problems)
    return batch


def _given_batch_size(data: Mapping[Any, Any], key: str) -> int | None:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def resolve_batch(
    data: Mapping[Any, Any], world: int
) -> tuple[tuple[int, int, int] | None, list[str]]:
    """``(train, micro, accumulation)`` derived as DeepSpeed does, or the problems found."""
    given = {key: _given_batch_size(data, key) for key in (_TRAIN, _MICRO, _ACCUMULATION)}
    if any(data.get(key) is not None and (v is None or v < 1) for key, v in given.items()):
        return None, []  # a batch size of the wrong type or range: the field check says so
    train, micro, accumulation = given[_TRAIN], given[_MICRO], given[_ACCUMULATION]
    if micro is None:
        if train is None:
            return None, [
                f"{_TRAIN}: not given, and neither is {_MICRO}; give at least one of them "
                f"({_TRAIN} = {_MICRO} * {_ACCUMULATION} * world size)"
            ]
        return _derive_micro(train, accumulation or 1, world)
    if accumulation is None:
        if train is not None:
            return _derive_accumulation(train, micro, world)
        accumulation = 1
    product = micro * accumulation * world
    if train is not None and train != product:
        return None, [
            f"{_TRAIN} {train} != {_MICRO} {micro} * {_ACCUMULATION} {accumulation} "
            f"* world size {world} = {product}{_one_rank_hint(train, micro * accumulation, world)}"
        ]
    return (product, micro, accumulation), []


def _derive_micro(
    train: int, accumulation: int, world: int
) -> tuple[tuple[int, int, int] | None, list[str]]:
    per_micro_batch = accumulation * world
    if train % per_micro_batch:
        return None, [
            f"{_MICRO}: cannot be derived: {_TRAIN} {train} is not divisible by "
            f"{_ACCUMULATION} {accumulation} * world size {world} = {per_micro_batch}"
        ]
    return (train, train // per_micro_batch, accumulation), []


def _derive_accumulation(
    train: int, micro: int, world: int
) -> tuple[tuple[int, int, int] | None, list[str]]:
    per_step = micro * world
    if train % per_step:
        return None, [
            f"{_ACCUMULATION}: cannot be derived: {_TRAIN} {train} is not divisible by "
            f"{_MICRO} {micro} * world size {world} = {per_step}"
        ]
    return (train, micro, train // per_step), []


def _one_rank_hint(train: int, per_rank: int, world: int) -> str:
    """What a train_batch_size of one rank's samples likely means: the program that filled it
    (Transformers' Trainer, Accelerate) counted a world of one. Accelerate does on a machine
    without an accelerator when its state is made before DeepSpeed's process group is up
    without a backend named; the compatibility package gives it the backend when it starts the
    group itself (its [Note: Accelerate's world on CPU]), this says what to write otherwise."""
    if world == 1 or train != per_rank:
        return ""
    return (
        f" ({_TRAIN} counts one rank's samples: whatever filled it saw a world of one, not "
        f"{world}; Accelerate does so on a machine without an accelerator unless its state "
        "names the backend: add `from accelerate import PartialState` and "
        '`PartialState(backend="gloo")` before the TrainingArguments or the Accelerator)'
    )
