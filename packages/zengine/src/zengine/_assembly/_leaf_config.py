"""``zero_optimization.leaf_module``: the config's ZeRO-3 leaf modules, marked on the model
before the engine partitions it (DeepSpeed's ``apply_zero_leaf_module_config``)."""

from __future__ import annotations

import logging

from torch import nn

import zpartition
from zengine._config import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
    DEFAULT_LEAF_MODULE_NAMES,
    LeafModuleConfig,
)

__all__ = ["mark_configured_leaves"]

log = logging.getLogger("zengine")


def mark_configured_leaves(model: nn.Module, section: LeafModuleConfig) -> list[nn.Module]:
    """Mark the modules of `model` the section names as ZeRO-3 leaves: of its classes, with its
    names, or ending with its suffixes; the marked modules, each once. Names or suffixes the
    user set that match nothing are warned about, as DeepSpeed does; the defaults (Hugging
    Face's MoE blocks) may match nothing without a word."""
    matched = zpartition.set_z3_leaf_modules(model, section.classes, raise_if_not_found=False)
    by_name, missing_names = zpartition.set_z3_leaf_modules_by_name(
        model, section.names, raise_if_not_found=False
    )
    by_suffix, missing_suffixes = zpartition.set_z3_leaf_modules_by_suffix(
        model, section.name_suffixes, raise_if_not_found=False
    )
    if missing_names and section.names != DEFAULT_LEAF_MODULE_NAMES:
        log.warning("zero_optimization.leaf_module.names: no modules named %s", missing_names)
    if missing_suffixes and section.name_suffixes != DEFAULT_LEAF_MODULE_NAME_SUFFIXES:
        log.warning(
            "zero_optimization.leaf_module.name_suffixes: no module names end with %s",
            missing_suffixes,
        )
    marked = list({id(m): m for m in [*matched, *by_name, *by_suffix]}.values())
    customized = (
        section.classes != DEFAULT_LEAF_MODULE_CLASSES
        or section.names != DEFAULT_LEAF_MODULE_NAMES
        or section.name_suffixes != DEFAULT_LEAF_MODULE_NAME_SUFFIXES
    )
    if customized and not marked:
        log.warning(
            "zero_optimization.leaf_module matched no module of the model; its modules are "
            "hooked one by one as usual"
        )
    return marked
