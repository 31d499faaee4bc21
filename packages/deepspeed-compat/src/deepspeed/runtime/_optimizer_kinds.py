"""DeepSpeed's optimizer classes as kinds of zengine's one ZeRO optimizer.

DeepSpeed builds a different optimizer class for each ZeRO stage and precision, and code written
against it (its own tests among it) tells them apart with ``isinstance``, then reads the
attributes of that class. zengine has one `ZeroOptimizer` for every stage, which answers to
each class's attribute names where its stage has them (zengine/_optim/_deepspeed_views.py).
Each class here is a test, not a type of its own: ``isinstance(engine.optimizer,
DeepSpeedZeroOptimizer_Stage3)`` holds when zengine's optimizer runs what DeepSpeed 0.19.8 would
have built that class for. They are made by ``deepspeed.initialize``, never called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

import zengine

__all__ = ["optimizer_kind"]


class _Kind(type):
    _holds: Callable[[zengine.ZeroOptimizer], bool]
    _when: str

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, zengine.ZeroOptimizer) and cls._holds(obj)

    def __subclasscheck__(cls, sub: type) -> bool:
        return sub is cls or issubclass(sub, zengine.ZeroOptimizer)

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            f"{cls.__name__} is built by deepspeed.initialize: zengine's ZeroOptimizer, {cls._when}"
        )


def optimizer_kind(name: str, when: str, holds: Callable[[zengine.ZeroOptimizer], bool]) -> type:
    """DeepSpeed's optimizer class `name`: zengine's optimizer when `holds` (said as `when`)."""
    return _Kind(name, (), {"_holds": staticmethod(holds), "_when": when, "__doc__": when})


def half_precision(optimizer: zengine.ZeroOptimizer) -> bool:
    """Whether the model trains in fp16 or bf16 (its parameters are; the masters are fp32)."""
    params = [p for group in optimizer.layout.params for p in group]
    return bool(params) and params[0].dtype in (torch.float16, torch.bfloat16)
