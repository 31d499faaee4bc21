"""``ds_tensor``: this rank's shard, a view of its unit's shard buffer that keeps what is written.

[Note: shard writes]
Code written for DeepSpeed writes a shard by giving it new data:
``param.ds_tensor.data = torch.full_like(param.ds_tensor.data, v)`` (DeepSpeed's own tests,
ms-swift). On a plain view that points the view at new storage, while the unit's shard buffer,
which the all-gather sends, keeps the old values: the write would be lost. So ``ds_tensor`` is
a `ShardTensor`, a ``torch.Tensor`` subclass sharing the view's storage, whose ``data`` setter
copies into the shard in place (dtype and device converted). A value of another shape is
refused, naming the ways that work: a unit's layout is fixed when it is built.

Nothing is paid when nothing is written: ``__torch_function__`` is torch's disabled
implementation, so an operation on a `ShardTensor` costs what it costs on a plain tensor and
returns a plain tensor, and no step looks at it. The type is one of torch's foreach-supported
types (as torch's own DTensor registers itself), so optimizers over shards keep their foreach
kernels. The next gather sees the write: a released unit gathers its shard, a persistent one
sees its shards' version move (`Unit.refresh`), with one rank the shard is the data.

``ds_tensor.data = t`` and ``ds_tensor.copy_(t)`` are recorded in the unit's journal (a
partitioned model's), from which an engine that keeps fp32 masters apart from the shards learns
which of them to re-read before its next step (`Partitioned.take_written`). Other in-place
writes (``fill_``, ``ds_tensor[:n] = x``) reach the shard and the next gather just the same,
but are not recorded: an optimizer's step writes that way too, and masters must not be re-read
from the rounded shards after every step.

Rebinding the attribute, ``param.ds_tensor = t``, replaces no memory anything reads. Before the
model is partitioned it is honoured: `partition` builds its units from whatever ``ds_tensor``
is (that is how an engine casts or moves the shards of a model built under `Init`). After, no
setter runs; each pass begins by checking, one identity test per parameter, that every
``ds_tensor`` is still the unit's (`check_bound`): a tensor on the shard's own memory is taken
back, anything else raises, naming the supported writes.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Sequence
from typing import Any

import torch

from zpartition._errors import ZeroParamError
from zpartition._param import UnitView, ZeroParameter
from zpartition._status import ZeroParamStatus

__all__ = ["ShardTensor", "check_bound", "make_shard", "retire"]

_DATA = inspect.getattr_static(torch.Tensor, "data")  # torch's own getter and setter

SUPPORTED = (
    "write the shard in place instead: `param.ds_tensor.data = t` or "
    "`param.ds_tensor.copy_(t)` with t of the shard's shape (any dtype or device), or the full "
    "parameter with `zpartition.GatheredParameters([param], modifier_rank=0)`, or (with "
    "zengine) `zengine.utils.safe_set_full_fp32_param` / `safe_set_local_fp32_param`"
)


class ShardTensor(torch.Tensor):
    """A ``ds_tensor``: a plain tensor, except that ``.data = t`` and ``.copy_(t)`` write the
    unit's shard in place (see [Note: shard writes])."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    _zp_unit: UnitView | None  # the unit whose shard this is; None once a new unit replaced it
    _zp_param: ZeroParameter  # the parameter it is the shard of (named in the journal)

    @property
    def data(self) -> torch.Tensor:
        plain: torch.Tensor = _DATA.__get__(self, torch.Tensor)  # a plain alias, as torch's
        return plain

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or value.shape != self.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ZeroParamError(
                f"{self._describe()}: `ds_tensor.data =` a value of shape {got}; the shard has "
                f"shape {tuple(self.shape)} and keeps it (the unit's layout is fixed); " + SUPPORTED
            )
        self._write(value)

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        self._write(src, non_blocking)  # torch's copy_: `src` broadcast, or torch's error
        return self

    def _write(self, value: torch.Tensor, non_blocking: bool = False) -> None:
        unit = self._zp_unit
        if unit is None:
            raise ZeroParamError(
                f"{self._describe()}: this ds_tensor is the shard of a unit the model no longer "
                "uses (the model was partitioned since it was read); read `param.ds_tensor` anew"
            )
        # parameter offload to files, or a frozen unit kept as codes: bring the shard in first
        unit.bring_in()
        if unit.shard.untyped_storage().nbytes() < unit.shard.numel():
            raise ZeroParamError(
                f"{self._describe()}: its shard is offloaded (offload_states); reload it first"
            )
        with torch.no_grad():
            torch.Tensor.copy_(self, value, non_blocking=non_blocking)
        if unit.status is ZeroParamStatus.NOT_AVAILABLE:
            unit.put_away()  # the store, or the codes, keep what was written
        if unit.journal is not None:
            unit.journal.append(self._zp_param)

    def _describe(self) -> str:
        param = self._zp_param
        return f"parameter {getattr(param, 'ds_name', None) or f'ds_id {param.ds_id}'}"

    # shown, saved and copied as the plain tensor it is: a checkpoint must not name this class
    def __repr__(self, **kwargs: Any) -> Any:  # type: ignore[override]
        return torch.Tensor.__repr__(self.as_subclass(torch.Tensor), **kwargs)  # type: ignore[no-untyped-call]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)  # type: ignore[no-untyped-call]

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return copy.deepcopy(self.as_subclass(torch.Tensor), memo)


def _register_foreach() -> None:
    """Let torch's optimizers and foreach utilities take shards on their foreach path (they
    check types exactly; torch's DTensor registers itself the same way)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for module in (optimizer, _foreach_utils):
        types: list[type] | None = getattr(module, "_foreach_supported_types", None)
        if types is not None and ShardTensor not in types:
            types.append(ShardTensor)


_register_foreach()


def make_shard(view: torch.Tensor, unit: UnitView, param: ZeroParameter) -> ShardTensor:
    """A `ShardTensor` on `view`'s memory (a slice of `unit`'s shard buffer) for `param`."""
    shard = torch.Tensor._make_subclass(ShardTensor, view, False)
    shard._zp_unit = unit
    shard._zp_param = param
    return shard


def retire(param: ZeroParameter) -> None:
    """`param`'s shard moves to a new unit (`partition` over a model built under `Init`): the
    old unit's ``ds_tensor``, which someone may still hold, refuses writes from now on, as they
    would be lost."""
    old = getattr(param, "ds_unit", None)
    if old is not None:
        for attributes, shard in old.bound:
            if attributes is param.__dict__:
                shard._zp_unit = None


def check_bound(bound: Sequence[tuple[dict[str, Any], ShardTensor]]) -> None:
    """Every parameter's ``ds_tensor`` (read from its ``__dict__``) is still its unit's shard:
    one identity test each. A tensor on the shard's own memory (``p.ds_tensor =
    p.ds_tensor.view(-1)``) is taken back; anything else raises."""
    now = map(_DS_TENSOR, map(_FIRST, bound))
    if all(map(operator.is_, now, map(_SECOND, bound))):
        return  # the hot path, once a pass: compared in C, no call per parameter
    for attributes, shard in bound:
        if attributes.get("ds_tensor") is not shard:
            _rebound(attributes, shard)


_DS_TENSOR = operator.methodcaller("get", "ds_tensor")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _rebound(attributes: dict[str, Any], shard: ShardTensor) -> None:
    now = attributes.get("ds_tensor")
    if isinstance(now, ShardTensor) and now._zp_unit is not None and shard._zp_unit is None:
        return  # the model was partitioned again (`retire`): these hooks' units are stale
    same = (
        isinstance(now, torch.Tensor)
        and now.shape == shard.shape
        and now.dtype == shard.dtype
        and now.device == shard.device
        and now.data_ptr() == shard.data_ptr()
    )
    if same:
        attributes["ds_tensor"] = shard
        return
    raise ZeroParamError(
        f"{shard._describe()}: `param.ds_tensor` was replaced by another tensor after the model "
        "was partitioned; the gathers read the unit's shard, so the new tensor would be "
        "ignored. " + SUPPORTED[0].upper() + SUPPORTED[1:]
    )
