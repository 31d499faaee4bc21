"""Writes after construction inside `Init`: a torch function mode that gathers what they touch.

[Note: writes after construction]
`Init` cuts a module's parameters when its ``__init__`` returns. Code that initialises weights
after a child was built, Hugging Face's ``post_init`` above all (``initialize_weights``: a
recursion of its own, not ``nn.Module.apply``, calling ``torch.nn.init`` on every child), would
write into the children's empty tensors, and the writes would be lost. While an `Init` context is
entered, `InitWrites` (a ``TorchFunctionMode``) looks at the operations that write a tensor or
hand out its memory:

- in-place methods and functions (a name ending in ``_``: ``normal_``, ``copy_``, ``torch.zero_``)
  and in-place operators (``+=``), and any operation given an ``out=`` tensor;
- the ``torch.nn.init`` functions that dispatch as a whole (``uniform_``, ``normal_``,
  ``constant_``, ``kaiming_uniform_``), and shape reads (``dim()``, ``size()``, ``shape``,
  ``is_meta``) made *by* ``torch.nn.init`` code: its other functions (``xavier_*``,
  ``kaiming_normal_``, ``trunc_normal_``, ``orthogonal_``, ``eye_``) read the shape before they
  write, and must see the full one;
- ``__getitem__``, ``__setitem__`` and the ``Tensor.data`` getter: they return views that are
  written afterwards (``init.zeros_(weight[padding_idx])``, ``weight.data.normal_()``).

When one of them names a partitioned parameter that is not gathered, every partitioned
parameter it names is gathered and *held* (a `GatheredParameters` with ``modifier_rank=0``,
entered), and the operation runs on the full tensors. The hold is let go lazily: when another
operation gathers other parameters, when a module's ``__init__`` returns (before that module's
own parameters are cut) and when `Init` exits; letting go broadcasts rank 0's values into every
rank's shard. So a rank holds one operation's parameters at most, never the model, and a view
handed out by one operation is still backed by the full data when the next one writes through
it. Rank 0's computation is then exactly the one without `Init` (it always reads its own
values back), so with one rank, or the same seed everywhere, the values are bit-identical.

Not intercepted: other reads of a partitioned parameter (``param.shape``, ``numel()``, ``dim()``
outside ``torch.nn.init``, ``clone()``, a matmul) see its empty tensor, as with DeepSpeed
(gathering for every shape read would gather for every ``__init__`` that looks at a child), and
``param.data = t`` on a parameter not gathered replaces nothing that lasts. ``nn.Module.apply``
gathers each module's own parameters around its function (see `_init`), which covers shape
reads there. Each touch is a collective: every rank must make the same ones in the same order,
as when every rank runs the same ``__init__``.

[Note: reentrancy]
zpartition's own code moves parameters' data while the mode is on: the gathers and releases of
the holds, the cut of each module, ``apply``'s gathering, and the hooks and `GatheredParameters`
a user runs inside the context. None of it must be taken for a user's write. Inside
``__torch_function__`` torch has popped the mode, so what the handler does (gather, let go, run
the operation) is never seen by it. Outside the handler, `Init` runs its own moves under
`suspended()`, which the handler checks first. The hooks and `GatheredParameters` need nothing:
the one thing they do to a parameter that is not gathered is set its ``.data``, which the mode
does not intercept; everything else they touch is gathered, or no parameter at all.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import itertools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from zpartition._gathered import GatheredParameters
from zpartition._param import ZeroParameter
from zpartition._status import ZeroParamStatus

__all__ = ["InitWrites", "let_go", "start", "stop", "suspended"]


class _Kind(enum.Enum):
    OTHER = 0  # passed through at once
    WRITE = 1  # gathers the unavailable partitioned parameters it names
    SHAPE = 2  # gathers them only when torch.nn.init code asks


_DATA = inspect.getattr_static(torch.Tensor, "data").__get__
_SHAPE_GETTERS = tuple(
    inspect.getattr_static(torch.Tensor, n).__get__ for n in ("shape", "is_meta")
)
_SHAPE_METHODS = frozenset({"dim", "ndimension", "size", "numel", "nelement"})
_IN_PLACE_OPERATORS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__", "__ifloordiv__"}
    | {"__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
)
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_"})  # flags, not values
_kinds: dict[object, _Kind] = {}  # what each function seen is, computed once


def _classify(func: Callable[..., Any]) -> _Kind:
    if func == _DATA:
        return _Kind.WRITE
    if any(func == getter for getter in _SHAPE_GETTERS):
        return _Kind.SHAPE
    name: str = getattr(func, "__name__", "")
    if getattr(func, "__module__", None) == "torch.nn.init":
        return _Kind.WRITE
    if name in ("__getitem__", "__setitem__") or name in _IN_PLACE_OPERATORS:
        return _Kind.WRITE
    if name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES:
        return _Kind.WRITE
    return _Kind.SHAPE if name in _SHAPE_METHODS else _Kind.OTHER


def _kind(func: Callable[..., Any]) -> _Kind:
    try:
        kind = _kinds.get(func)
        if kind is None:
            kind = _kinds[func] = _classify(func)
    except TypeError:  # an unhashable callable: not one of torch's own
        kind = _classify(func)
    return kind


def _partitioned_in(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[ZeroParameter]:
    """The partitioned parameters among the arguments (and in lists of them, as ``_foreach``'s):
    one attribute read per argument."""
    found: list[ZeroParameter] = []
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, (list, tuple)):
            found += [x for x in a if getattr(x, "ds_unit", None) is not None]
        elif getattr(a, "ds_unit", None) is not None:
            found.append(a)
    return found


_suspended = 0  # > 0 while zpartition itself moves parameters (see [Note: reentrancy])


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """The mode passes every operation through inside (reentrant)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


class InitWrites(TorchFunctionMode):
    """Gathers and holds the partitioned parameters an operation writes (see the module's
    [Note: writes after construction]); one per outermost `Init` context."""

    def __init__(self) -> None:
        super().__init__()
        self.held: GatheredParameters | None = None  # the last touch's parameters, gathered

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not _suspended:
            kind = _kind(func)
            if kind is not _Kind.OTHER or "out" in kwargs:
                named = _partitioned_in(args, kwargs)
                if any(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in named) and (
                    kind is not _Kind.SHAPE or _from_torch_init(sys._getframe(1))
                ):
                    self.hold(named)
        return func(*args, **kwargs)

    def hold(self, params: list[ZeroParameter]) -> None:
        """Let the last hold go, then gather `params` and hold them. The held parameters among
        `params` are let go too (their changes kept) and gathered again: simpler than a split,
        and rare (an operation naming a held parameter and one not gathered)."""
        self.let_go()
        # whole units: a unit is gathered whole, and its other parameters, available now, are
        # written without a touch (``init.zeros_(bias)`` after ``init.normal_(weight)``)
        units = [p.ds_unit for p in params if p.ds_unit is not None]
        held = GatheredParameters([q for u in units for q in u.params], modifier_rank=0)
        held.__enter__()
        self.held = held

    def let_go(self, exc_type: type[BaseException] | None = None) -> None:
        """Broadcast rank 0's values of the held parameters into the shards and release them;
        after an exception (`exc_type`), only release: no collective on a failing path."""
        held, self.held = self.held, None
        if held is not None:
            with suspended():
                held.__exit__(exc_type, None, None)


def _from_torch_init(frame: FrameType | None) -> bool:
    """Whether a shape read called from `frame` is torch.nn.init's: its caller, or a caller a
    few frames up (another mode above this one, as ``torch.device(...)``'s, calls in between)."""
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == "torch.nn.init":
            return True
        frame = frame.f_back
    return False


_mode: InitWrites | None = None  # on the mode stack while an Init context is entered


def start() -> None:
    """Push the mode (the outermost `Init` was entered)."""
    global _mode
    assert _mode is None, "the write mode is pushed once, by the outermost Init"
    _mode = InitWrites()
    _mode.__enter__()  # type: ignore[no-untyped-call]


def stop(exc_type: type[BaseException] | None = None) -> None:
    """Let the hold go and pop the mode (the last `Init` exits)."""
    global _mode
    mode, _mode = _mode, None
    if mode is not None:
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        mode.let_go(exc_type)


def let_go() -> None:
    """Let the hold go: a module's ``__init__`` returned (its own parameters are cut next)."""
    if _mode is not None:
        _mode.let_go()
