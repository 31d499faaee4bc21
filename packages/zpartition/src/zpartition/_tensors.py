"""Tensor helpers: recognising ZeRO-3 parameters, and mapping a function over nested tensors.

`apply_to_tensors_only` is how module hooks reach the tensors in a forward's inputs and outputs
(to wrap them in the autograd functions that trigger backward fetch and release) whatever
tuples, lists and dicts they are nested in. It follows DeepSpeed's
``deepspeed.runtime.zero.utils.apply_to_tensors_only``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar, cast

import torch

from zcomm import get_rank, is_initialized

__all__ = ["apply_to_tensors_only", "is_zero_param"]

logger = logging.getLogger("zpartition")

T = TypeVar("T")
_TensorFn = Callable[[torch.Tensor], torch.Tensor]
_WarningFn = Callable[[object], str]

# Types already warned about: one warning per type and process, not one per forward.
_warned_types: set[type] = set()


def is_zero_param(p: object) -> bool:
    """Whether `p` is a ZeRO-3 partitioned parameter: a tensor carrying ``ds_id``."""
    return isinstance(p, torch.Tensor) and hasattr(p, "ds_id")


def apply_to_tensors_only(
    function: _TensorFn, value: T, warning_msg_fn: _WarningFn | None = None
) -> T:
    """`value` with `function` applied to every tensor in it, through nested containers.

    Tuples and lists (namedtuples included) are rebuilt with the same type; dicts (and dict
    subclasses, which may not be rebuildable) are updated in place, as DeepSpeed does. When
    `function` maps a ZeRO-3 parameter to a tensor that is not one, the result gets
    ``ds_param_alias``, the original parameter, so hooks further on can still find it. Any other
    object is returned unchanged; if it is not of a builtin type and `warning_msg_fn` is given,
    ``warning_msg_fn(obj)`` is logged once per type, on rank 0 (hooks cannot see inside it).
    """
    return cast(T, _apply(function, value, warning_msg_fn))


def _apply(function: _TensorFn, value: object, warning_msg_fn: _WarningFn | None) -> object:
    if isinstance(value, tuple | list):
        items = [_apply(function, item, warning_msg_fn) for item in value]
        rebuild: Callable[..., object] = type(value)
        if _is_namedtuple(value):
            return rebuild(*items)  # namedtuples take fields, not one iterable
        return rebuild(items)
    if isinstance(value, dict):
        for key in list(value):
            value[key] = _apply(function, value[key], warning_msg_fn)
        return value
    if isinstance(value, torch.Tensor):
        return _apply_to_tensor(function, value)
    if warning_msg_fn is not None and not _is_builtin(value):
        _warn_once(value, warning_msg_fn)
    return value


def _apply_to_tensor(function: _TensorFn, tensor: torch.Tensor) -> torch.Tensor:
    result = function(tensor)
    # An autograd function's output drops the ds_* attributes; keep a way back to the param.
    if is_zero_param(tensor) and not is_zero_param(result):
        result.ds_param_alias = tensor  # type: ignore[attr-defined]
    return result


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_asdict") and hasattr(value, "_fields")


def _is_builtin(value: object) -> bool:
    return type(value).__module__ == "builtins"


def _warn_once(value: object, warning_msg_fn: _WarningFn) -> None:
    kind = type(value)
    if kind in _warned_types:
        return
    _warned_types.add(kind)
    if not is_initialized() or get_rank() == 0:
        logger.warning(warning_msg_fn(value))
