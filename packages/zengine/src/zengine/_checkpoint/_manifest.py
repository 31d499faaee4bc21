"""The manifest of a checkpoint: what model and optimizer it is of, checked on load.

A checkpoint loads into any world size and any ZeRO stage (it is keyed by parameter name), but
not into another model or another optimizer: `check` lists every difference (a parameter missing
or extra, a shape, a frozen parameter now trained, the optimizer type, the parameter groups) in
one error, rather than DCP's first missing key.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from zengine.__about__ import __version__
from zengine._checkpoint._engine_view import CheckpointEngine
from zengine._checkpoint._errors import CheckpointMismatchError
from zengine._checkpoint._state import full_shape, persistent_buffers

__all__ = ["FORMAT", "check", "check_format", "describe"]

FORMAT = 1  # bumped when the layout of the keys changes
_SHOWN = 8  # differences listed per kind before "and N more"

log = logging.getLogger("zengine")


def _groups(engine: CheckpointEngine) -> dict[int, int]:
    """id(param) -> index of its optimizer parameter group (none without an optimizer)."""
    if engine.optimizer is None:
        return {}
    return {id(p): g for g, params in enumerate(engine.optimizer.layout.params) for p in params}


def describe(engine: CheckpointEngine, exclude_frozen: bool = False) -> dict[str, Any]:
    """What a checkpoint of `engine` is of (the manifest, without the files); without its
    frozen parameters with `exclude_frozen`."""
    groups = _groups(engine)
    params = {
        name: {
            "shape": list(full_shape(p)),
            "dtype": str(getattr(p, "ds_tensor", p).dtype).removeprefix("torch."),
            "group": groups.get(id(p)),  # None: frozen, no master and no optimizer state
        }
        for name, p in engine.module.named_parameters()
        if not exclude_frozen or id(p) in groups
    }
    buffers = {name: list(b.shape) for name, b in persistent_buffers(engine.module)}
    # a parameter under several names (tied weights) is saved under its first, as
    # named_parameters() gives it; the others are recorded so a consolidated state dict has them
    first: dict[int, str] = {}
    shared = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name and first[id(p)] in params:
            shared[name] = first[id(p)]
    optimizer = engine.optimizer
    scaler = optimizer.loss_scaler if optimizer is not None else None
    return {
        "format": FORMAT,
        "zengine": __version__,
        "world_size": dist.get_world_size(engine.group),
        "zero_stage": engine.zero_optimization_stage(),
        "loss_scaler": type(scaler).__name__ if scaler is not None else None,
        "optimizer": type(optimizer.optimizer).__name__ if optimizer is not None else None,
        "param_groups": len(optimizer.param_groups) if optimizer is not None else 0,
        "params": params,
        "buffers": buffers,
        "shared": shared,  # other name -> the name the parameter is saved under
        "frozen_excluded": exclude_frozen,
    }


def _listed(kind: str, names: list[str]) -> list[str]:
    if not names:
        return []
    shown = ", ".join(names[:_SHOWN])
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return [f"{kind}: {shown}{more}"]


def name_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Parameters and buffers one side has and the other has not."""
    old, new = saved["params"], now["params"]
    out = _listed("parameters in the checkpoint but not in the model", sorted(old.keys() - new))
    out += _listed("parameters in the model but not in the checkpoint", sorted(new.keys() - old))
    out += _listed(
        "buffers in the checkpoint but not in the model",
        sorted(saved["buffers"].keys() - now["buffers"]),
    )
    out += _listed(
        "buffers in the model but not in the checkpoint",
        sorted(now["buffers"].keys() - saved["buffers"]),
    )
    return out


def _trainable_differ(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a trainable parameter (one with optimizer state) is on one side only."""
    old, new = saved["params"], now["params"]
    return any(old[n]["group"] is not None for n in old.keys() - new) or any(
        new[n]["group"] is not None for n in new.keys() - old
    )


def param_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs in the parameters both sides have."""
    old, new = saved["params"], now["params"]
    both = sorted(old.keys() & new.keys())
    out = []
    out += _listed(
        "shapes differ (checkpoint vs model)",
        [
            f"{n} {tuple(old[n]['shape'])} vs {tuple(new[n]['shape'])}"
            for n in both
            if old[n]["shape"] != new[n]["shape"]
        ],
    )
    out += _listed(
        "trainable in the model but frozen in the checkpoint (no master weights saved)",
        [n for n in both if new[n]["group"] is not None and old[n]["group"] is None],
    )
    return out


def optimizer_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = []
    if saved["optimizer"] != now["optimizer"]:
        out.append(f"optimizer: {saved['optimizer']} in the checkpoint, {now['optimizer']} now")
    if saved["param_groups"] != now["param_groups"]:
        out.append(
            f"optimizer parameter groups: {saved['param_groups']} in the checkpoint, "
            f"{now['param_groups']} now"
        )
    old, new = saved["params"], now["params"]
    moved = [
        f"{n} (group {old[n]['group']} vs {new[n]['group']})"
        for n in sorted(old.keys() & new.keys())
        if None not in (old[n]["group"], new[n]["group"]) and old[n]["group"] != new[n]["group"]
    ]
    return out + _listed("parameters in another optimizer group", moved)


def check_format(saved: dict[str, Any], where: str) -> None:
    """`CheckpointMismatchError` unless the manifest `saved` is of the format this reads."""
    if saved.get("format") != FORMAT:
        raise CheckpointMismatchError(
            f"{where}: checkpoint format {saved.get('format')!r}, this zengine reads {FORMAT}"
        )


def check(
    saved: dict[str, Any],
    engine: CheckpointEngine,
    *,
    where: str,
    optimizer: bool,
    strict: bool = True,
) -> None:
    """Raise `CheckpointMismatchError` listing what differs between the checkpoint's manifest
    and `engine`; log what differs but reshards (world size, stage, precision). Not `strict`
    (``load_module_strict=False``), parameters and buffers only one side has are logged, not
    errors, unless the optimizer's state is to be loaded too (it is laid out over them all)."""
    check_format(saved, where)
    now = describe(engine)
    names = name_differences(saved, now)
    problems = param_differences(saved, now)
    if strict or (optimizer and _trainable_differ(saved, now)):
        problems = names + problems
        if names and strict and saved.get("frozen_excluded"):
            problems.append(
                "saved with exclude_frozen_parameters=True: load it with load_module_strict=False"
            )
        if not strict:
            problems.append(
                "load_module_strict=False loads a model with other trainable parameters only "
                "with load_optimizer_states=False (the optimizer's state is laid out over them)"
            )
    elif names:
        log.warning("zengine: %s: loading what both have; %s", where, "; ".join(names))
    if optimizer:
        problems += optimizer_differences(saved, now)
    if problems:
        lines = "\n  ".join(problems)
        raise CheckpointMismatchError(
            f"{where} is not a checkpoint of this model and config:\n  {lines}"
        )
    for key in ("world_size", "zero_stage", "loss_scaler"):
        if saved[key] != now[key]:
            log.info(
                "zengine: %s: %s %s in the checkpoint, %s now", where, key, saved[key], now[key]
            )
