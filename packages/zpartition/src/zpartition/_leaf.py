"""ZeRO-3 leaf modules: subtrees whose parameters are gathered all at once.

No hooks are installed below a leaf; entering it fetches every parameter of its subtree. This
serves modules whose children run in an order that changes from step to step (MoE experts:
the recorded fetch order would be invalidated every step) and very fine-grained modules, where
one fetch per tiny child costs more in hook overhead than it saves in memory.

The names and semantics are DeepSpeed's (``deepspeed.utils.z3_leaf_module``), plus
`leaf_modules_by_granularity`, which is DeepSpeed's ``stage3_module_granularity_threshold``.

[Note: the leaf mark] The mark is the instance attribute ``_z3_leaf`` (DeepSpeed's name, which
other libraries may read), written to and read from ``module.__dict__``. Going around
``__getattr__``/``__setattr__`` keeps the mark out of ``_parameters``/``_modules`` and keeps
attribute-delegating wrappers (PEFT's ``ModulesToSaveWrapper``) from reporting the mark of the
module they wrap as their own.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

__all__ = [
    "get_z3_leaf_modules",
    "is_container",
    "leaf_modules_by_granularity",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

logger = logging.getLogger("zpartition")

_LEAF_ATTR = "_z3_leaf"
# A leaf's whole subtree is live at once; above this size that memory outweighs any saving.
_MAX_LEAF_NUMEL = 10**9
# Containers are never leaves: a ModuleList's forward is never called, so hooks on it never fire
# and its children's parameters would never be gathered. DeepSpeed compares class names; an
# isinstance test also covers subclasses, which are no more callable.
_CONTAINERS: tuple[type[nn.Module], ...] = tuple(
    getattr(torch.nn.modules.container, name) for name in torch.nn.modules.container.__all__
)

_ModuleClasses = Sequence[type[nn.Module] | str]


def is_container(module: nn.Module) -> bool:
    """Whether `module` is one of torch's containers (its forward may never run)."""
    return isinstance(module, _CONTAINERS)


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (`flag` True) or unmark `model` itself as a ZeRO-3 leaf; its children are untouched."""
    model.__dict__[_LEAF_ATTR] = bool(flag)  # see [Note: the leaf mark]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` is marked as a ZeRO-3 leaf."""
    return bool(model.__dict__.get(_LEAF_ATTR, False))


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether `param` belongs to a leaf module (partitioning sets ``ds_z3_leaf_module`` on it)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` (itself included) marked as leaves, in pre-order."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: _ModuleClasses, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark as leaves the modules of `model` (itself included) of one of `leaf_module_classes`.

    An entry is a class (instances of it and of its subclasses match) or a class name (the
    class's ``__name__`` or its fully qualified ``module.qualname``). Returns the marked modules
    in pre-order. When nothing matched, raises a ValueError naming the classes if
    `raise_if_not_found`, else returns an empty list.
    """
    return _mark_by_class(
        "set_z3_leaf_modules", model, leaf_module_classes, True, raise_if_not_found
    )


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: _ModuleClasses, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Unmark the modules of `model` of one of `leaf_module_classes`; see `set_z3_leaf_modules`."""
    return _mark_by_class(
        "unset_z3_leaf_modules", model, leaf_module_classes, False, raise_if_not_found
    )


def set_z3_leaf_modules_by_name(
    model: nn.Module,
    module_names: Sequence[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[nn.Module], list[str]]:
    """Mark (or with `flag` False, unmark) the modules named `module_names`.

    Names are those of ``model.named_modules()`` (``""`` is `model` itself; a shared module
    answers to each of its names). Returns the matched modules and the names not found. Unknown
    names raise a ValueError listing them if `raise_if_not_found`, before anything is marked.
    """
    _check_strings("set_z3_leaf_modules_by_name", "module_names", module_names)
    by_name = dict(_all_named_modules(model))
    missing = [name for name in module_names if name not in by_name]
    _raise_if_missing(raise_if_not_found, missing, f"No modules named {missing}", model)
    return _mark(_unique(by_name[name] for name in module_names if name in by_name), flag), missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module,
    module_name_suffixes: Sequence[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[nn.Module], list[str]]:
    """Mark (or unmark) every module whose ``named_modules()`` name ends with one of the suffixes.

    Matching is plain string ``endswith``, as in DeepSpeed: ``"mlp"`` also matches
    ``"layers.0.shared_mlp"``. Returns the matched modules in model order and the suffixes that
    matched nothing; those raise a ValueError if `raise_if_not_found`, before anything is marked.
    """
    _check_strings("set_z3_leaf_modules_by_suffix", "module_name_suffixes", module_name_suffixes)
    named = list(_all_named_modules(model))
    missing = [s for s in module_name_suffixes if not any(n.endswith(s) for n, _ in named)]
    _raise_if_missing(raise_if_not_found, missing, f"No modules matching suffixes {missing}", model)
    suffixes = tuple(module_name_suffixes)
    return _mark(_unique(m for n, m in named if n.endswith(suffixes)), flag), missing


def _mark_by_class(
    op: str, model: nn.Module, classes: _ModuleClasses, flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    _check_classes(op, classes)
    matched = [m for m in model.modules() if any(_is_of(m, cls) for cls in classes)]
    if not matched:
        names = ", ".join(c.__qualname__ if isinstance(c, type) else repr(c) for c in classes)
        _raise_if_missing(raise_if_not_found, classes, f"No modules of class {names}", model)
    return _mark(matched, flag)


def _is_of(module: nn.Module, cls: type[nn.Module] | str) -> bool:
    if isinstance(cls, type):
        return isinstance(module, cls)
    kind = type(module)
    return cls in (kind.__name__, f"{kind.__module__}.{kind.__qualname__}")


def _check_classes(op: str, classes: object) -> None:
    # A bare class or name would otherwise be iterated (a str character by character).
    if isinstance(classes, str | type) or not isinstance(classes, Sequence):
        raise TypeError(
            f"{op}(leaf_module_classes=...): expected a list of classes or class names, "
            f"got {type(classes).__name__}"
        )
    bad = [c for c in classes if not isinstance(c, str | type)]
    if bad:
        raise TypeError(f"{op}: leaf_module_classes entries must be classes or names, got {bad}")


def _check_strings(op: str, arg: str, values: object) -> None:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise TypeError(f"{op}({arg}=...): expected a list of str, got {type(values).__name__}")
    bad = [v for v in values if not isinstance(v, str)]
    if bad:
        raise TypeError(f"{op}: {arg} entries must be str, got {bad}")


def _raise_if_missing(raise_: bool, missing: Sequence[object], what: str, model: nn.Module) -> None:
    if raise_ and missing:
        raise ValueError(f"{what} found in model {type(model).__name__}")


def _all_named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    # Keep duplicates so a shared module can be named by any of its paths.
    yield from model.named_modules(remove_duplicate=False)


def _unique(modules: Iterable[nn.Module]) -> list[nn.Module]:
    seen: set[int] = set()
    out: list[nn.Module] = []
    for module in modules:
        if id(module) not in seen:
            seen.add(id(module))
            out.append(module)
    return out


def _mark(modules: list[nn.Module], flag: bool) -> list[nn.Module]:
    for module in modules:
        set_z3_leaf_module(module, flag)
    return modules


# --- granularity: DeepSpeed's stage3_module_granularity_threshold ---------------------------


def _full_numel(param: nn.Parameter) -> int:
    # A partitioned parameter's .data is empty; ds_numel is its full size.
    return int(getattr(param, "ds_numel", param.numel()))


def leaf_modules_by_granularity(
    model: nn.Module, threshold: int, *, numel: Callable[[nn.Parameter], int] = _full_numel
) -> list[nn.Module]:
    """Mark as leaves the outermost modules whose granularity is at most `threshold`.

    A module's granularity is the number of parameter elements in its subtree divided by the
    number of layers in it (see `_measure`); a low value means many small layers, where per-module
    fetches cost more in hook overhead than they save. Walking from `model` in pre-order, the
    first module at or below `threshold` becomes a leaf and its subtree is not visited. Torch
    containers, childless modules, modules without parameters and modules of over 1e9 elements
    never become leaves. A `threshold` of 0 or less marks nothing. `numel` gives a parameter's
    full size (default: ``ds_numel``, else ``numel()``). Returns the marked modules.
    """
    if threshold <= 0:
        return []
    granularity: dict[int, int] = {}  # id(module) -> granularity; ids survive odd __eq__/__hash__
    _measure(model, numel, granularity)
    measured = ((m, granularity.get(id(m), sys.maxsize)) for m in model.modules())
    smallest = min(
        ((m, g) for m, g in measured if _eligible(g)), key=lambda item: item[1], default=None
    )
    if smallest is None or smallest[1] > threshold:
        _warn_too_small(threshold, smallest)
        return []
    chosen: list[nn.Module] = []
    _select(model, threshold, granularity, chosen)
    chosen = _mark(_unique(chosen), True)
    _log_chosen(model, threshold, chosen, granularity)
    return chosen


def _measure(
    module: nn.Module, numel: Callable[[nn.Parameter], int], out: dict[int, int]
) -> tuple[int, int]:
    """(layers, parameter elements) of `module`'s subtree; records its granularity in `out`.

    A layer is a childless module with parameters, or a non-container module with children
    (one, plus its children's layers). Ineligible modules get ``sys.maxsize``.
    """
    out[id(module)] = sys.maxsize
    if next(module.parameters(), None) is None:
        return 0, 0  # parameter-free (GELU, Dropout): no fetch to save
    params = sum(numel(p) for p in module.parameters(recurse=False))
    children = list(module.children())
    if not children:
        return 1, params  # a torch leaf is already fetched whole; marking it changes nothing
    layers = 0
    for child in children:
        child_layers, child_params = _measure(child, numel, out)
        layers += child_layers
        params += child_params
    if is_container(module):
        return layers, params
    layers += 1
    if params <= _MAX_LEAF_NUMEL:
        out[id(module)] = params // layers
    return layers, params


def _eligible(granularity: int) -> bool:
    # sys.maxsize marks "never a leaf", even under a threshold of sys.maxsize.
    return granularity < sys.maxsize


def _select(
    module: nn.Module, threshold: int, granularity: dict[int, int], chosen: list[nn.Module]
) -> None:
    # Pre-order, so the outermost qualifying module wins and fewer, larger leaves result.
    if next(module.parameters(), None) is None:
        return
    value = granularity.get(id(module), sys.maxsize)
    if _eligible(value) and value <= threshold:
        chosen.append(module)
        return
    for child in module.children():
        _select(child, threshold, granularity, chosen)


def _warn_too_small(threshold: int, smallest: tuple[nn.Module, int] | None) -> None:
    if smallest is None:
        logger.warning(
            "stage3_module_granularity_threshold=%d: no module can be a leaf (every module with "
            "parameters is a container, has no children or is too large)",
            threshold,
        )
        return
    module, value = smallest
    logger.warning(
        "The smallest module granularity is [%s:%d]. To make stage3_module_granularity_threshold "
        "effective, set it >= %d. Current value: %d",
        type(module).__name__,
        value,
        value,
        threshold,
    )


def _log_chosen(
    model: nn.Module, threshold: int, chosen: list[nn.Module], granularity: dict[int, int]
) -> None:
    names = {id(m): name or "<root>" for name, m in model.named_modules()}
    described = ", ".join(
        f"{names[id(m)]} ({type(m).__name__}: {granularity[id(m)]})" for m in chosen
    )
    logger.info(
        "stage3_module_granularity_threshold=%d made %d module(s) ZeRO-3 leaves: %s",
        threshold,
        len(chosen),
        described,
    )
