"""External parameters: a parameter used by a module that does not own it.

A module keeps them in ``module._external_params`` (a dict keyed by ``ds_id``, as DeepSpeed
does) and gathers them with its own. They are found three ways: registered by the user
(`register_external_parameter`), read through another module's attribute during a forward (the
parameter dict below notices), or returned from a forward (the hooks notice, and move the
registration up to the module that consumes the output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zpartition._status import ZeroParamStatus

__all__ = [
    "ParamDict",
    "external_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
]

_NOT_AVAILABLE = ZeroParamStatus.NOT_AVAILABLE


def _externals(module: nn.Module) -> dict[int, torch.Tensor]:
    found = module.__dict__.get("_external_params")
    if found is None:
        found = {}
        module.__dict__["_external_params"] = found
    return found


def _changed(module: nn.Module) -> None:
    on_change = module.__dict__.get("_zp_on_externals_changed")
    if on_change is not None:
        on_change()


def external_parameters(module: nn.Module) -> list[tuple[int, torch.Tensor]]:
    """`module`'s external parameters as ``(ds_id, parameter)`` pairs: DeepSpeed's
    ``module.ds_external_parameters()``, which every partitioned module has, for tools that
    walk a ZeRO-3 model's parameters with ``named_parameters`` and these (TRL's generation)."""
    return list(module.__dict__.get("_external_params", {}).items())


def register_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    """Gather `parameter` whenever `module` runs, though another module owns it."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got {module!r}")
    if not isinstance(parameter, torch.Tensor) or not hasattr(parameter, "ds_id"):
        raise TypeError(
            "register_external_parameter: parameter must be a ZeRO-3 parameter (one "
            "partitioned by zpartition.Init or zpartition.partition)"
        )
    externals = _externals(module)
    if parameter.ds_id not in externals:
        externals[parameter.ds_id] = parameter
        _changed(module)


def unregister_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    """Undo `register_external_parameter`; an unknown pair is an error."""
    externals = _externals(module)
    if not hasattr(parameter, "ds_id") or parameter.ds_id not in externals:
        raise ValueError(
            "unregister_external_parameter: the parameter is not registered on "
            f"{type(module).__name__}"
        )
    del externals[parameter.ds_id]
    _changed(module)


class ParamDict(dict[str, Any]):
    """``module._parameters`` that notices a partitioned parameter read by another module.

    ``nn.Module.__getattr__`` looks parameters up with ``_parameters[name]``, so reading
    ``other.weight`` from inside some forward comes here. Unless the module running now is the
    owner, `on_read` registers the parameter on it and holds it gathered for it: reading it
    available is not enough, since the coordinator may release it before it is used.
    """

    __slots__ = ("on_read", "owner", "stack")

    def __init__(
        self,
        items: dict[str, Any],
        owner: object,
        stack: list[Any],
        on_read: Callable[[Any, Any], None],
    ) -> None:
        super().__init__(items)
        self.owner = owner  # the module's hook record (hooks compare it with the running one)
        self.stack = stack  # the modules whose forward runs, innermost last (the hooks' list)
        self.on_read = on_read  # the partitioned model's reader; it knows what is running

    def __getitem__(self, key: str) -> Any:
        value = dict.__getitem__(self, key)
        stack = self.stack
        # the owner reading its own, or a read outside any forward: nothing to do (the hot path)
        if value is not None and stack and stack[-1] is not self.owner:
            self.on_read(self.owner, value)
        return value

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))  # pickles and deep-copies as the plain dict it stands for
