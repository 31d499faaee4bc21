"""What ``save_checkpoint``'s `client_state` may hold: plain data, checked when it is saved.

[Note: client_state is plain data]
A checkpoint is loaded without running code from it (see _dcp_read.py), so it can hold only what
loads that way: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, tensors
(``torch.Tensor``, ``nn.Parameter``), ``torch.Size``, ``torch.dtype``, ``torch.device``, and
``list``, ``tuple``, ``dict`` and ``collections.OrderedDict`` of those (dict keys: ``None``,
``bool``, ``int``, ``float``, ``str``). Exactly these types: a subclass (a namedtuple, a
``defaultdict``, an enum member) pickles under its own class, which a load would refuse. Anything
else (a data loader's sampler, a ``torch.Generator``, a NumPy array, a user's class) is refused
by ``save_checkpoint`` on every rank, naming where in `client_state` it is and its type: save
its state (``generator.get_state()``, ``array.tolist()`` or a tensor) instead. DeepSpeed pickles
any object there, and runs whatever a checkpoint names when it loads one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

__all__ = ["client_state_problem"]

_SCALARS: tuple[type, ...] = (type(None), bool, int, float, str)
_LEAVES: tuple[type, ...] = (
    *_SCALARS,
    bytes,
    torch.Tensor,
    nn.Parameter,
    torch.Size,
    torch.dtype,
    torch.device,
)
_SEQUENCES: tuple[type, ...] = (list, tuple)
_MAPPINGS: tuple[type, ...] = (dict, OrderedDict)
_DEEPEST = 100  # nesting deeper than this is refused rather than recursed into


def _type_name(value: Any) -> str:
    cls = type(value)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def client_state_problem(client_state: Any) -> str | None:
    """Where `client_state` holds something other than plain data (see [Note: client_state is
    plain data]), and its type; None when it holds plain data only (or is None)."""
    if client_state is None:
        return None
    if type(client_state) not in _MAPPINGS:
        return f"client_state is a {_type_name(client_state)}, not a dict"
    return _problem(client_state, "client_state", 0)


def _problem(value: Any, where: str, depth: int) -> str | None:
    kind = type(value)
    if kind in _LEAVES:
        return None
    if depth > _DEEPEST:
        return f"{where} is nested more than {_DEEPEST} levels deep"
    if kind in _SEQUENCES:
        for i, item in enumerate(value):
            found = _problem(item, f"{where}[{i}]", depth + 1)
            if found:
                return found
        return None
    if kind in _MAPPINGS:
        for key, item in value.items():
            if type(key) not in _SCALARS:
                return f"{where} has a key of type {_type_name(key)} ({key!r})"
            found = _problem(item, f"{where}[{key!r}]", depth + 1)
            if found:
                return found
        return None
    return f"{where} is a {_type_name(value)}"
