"""The ranks agree on the config and the model's parameters before `initialize`'s first collective.

[Note: agreement at initialize]
`initialize` creates groups (MiCS's shard and replica groups, hpZ's), partitions and broadcasts
parameters; every rank must make the same calls in the same order. A config or a model that
differs between ranks made them pair one rank's call with another kind of call on the other:
``mics_shard_size`` 2 on one rank and 4 on another hung for the process group's timeout (30
minutes) without a word, a different ``stage3_param_persistence_threshold`` ended a rank through
gloo's abort. So before any of that, each rank gathers a fixed-size digest of every rank's
effective config and parameter layout (one all-gather of six int64 words per rank): a blake2b
over a canonical JSON of each. They match in the good case, and `initialize` goes on. On a
mismatch the ranks exchange the details (one ``zcomm.all_gather_object``, only then) and every rank
raises `RankMismatchError`, which names the differing keys with each rank's value, or the first
differing parameters. A rank whose own reading of the config failed takes part as well (its
first word says so), so the other ranks raise at once rather than wait in the next collective.

The layout is compared within the data-parallel group (model-parallel ranks hold other slices);
the config over the engine's ranks: the world, or only the data-parallel group when an ``mpu``
gives no model-parallel group (an engine on some of the ranks, the others never call
`initialize`). With one rank nothing is exchanged.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zcomm
from zengine._config import EngineConfig

__all__ = ["RankMismatchError", "Setup", "agree", "describe_setup"]

# Config keys that may differ between ranks on purpose, left out of the comparison.
_LOCAL_KEYS = (
    # each node's own disk: NVMe may be mounted at another path on each node, and the swap
    # files each rank writes there are its own (no rank reads another's)
    "zero_optimization.offload_param.nvme_path",
    "zero_optimization.offload_optimizer.nvme_path",
    # how this node's disk is read and written (queue depth, block size, threads): tuned per
    # node's hardware (ds_nvme_tune), and the reads and writes are this rank's alone
    "aio.",
    # logging: the progress line is rank 0's, and the time breakdown reads local clocks with
    # no collective; a run may print more on one rank
    "steps_per_print",
    "wall_clock_breakdown",
    # when this process hands freed heap memory back to the system: local to each process
    "host_memory_trim",
)
_SHOWN_PARAMETERS = 5  # the first differing parameters named; the rest counted
_SHOWN_KEYS = 20


class RankMismatchError(ValueError):
    """The ranks called `initialize` with configs or models that differ: every rank raises it,
    before any collective that would hang or fail on the difference. ``problems`` holds one
    line per differing config key (its dotted path and each rank's value) or parameter."""

    def __init__(self, problems: Iterable[str] | str) -> None:
        # A str is the joined message: unpickling passes it back (ranks send errors home).
        lines = problems.splitlines() if isinstance(problems, str) else list(problems)
        self.problems: tuple[str, ...] = tuple(lines)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Setup:
    """What must be the same on every rank: the effective config, flattened to dotted keys
    (values in canonical JSON form), and the model's parameters in order, each as (name,
    full shape, dtype, requires_grad, built under zero.Init, optimizer group or None)."""

    config: dict[str, Any]
    layout: list[tuple[str, list[int], str, bool, bool, int | None]]


def describe_setup(
    cfg: EngineConfig,
    model: nn.Module,
    groups: Sequence[Sequence[nn.Parameter]],
    options: Sequence[Mapping[str, Any]],
    optimizer: Any,
) -> Setup:
    """This rank's `Setup`: `cfg` as `load_config` resolved it (defaults filled in, batch sizes
    derived), the optimizer groups' options, and `model`'s parameters in order."""
    config = {k: v for k, v in _flatten(cfg.model_dump()).items() if not _is_local(k)}
    config["initialize(optimizer=...)"] = _kind(optimizer)
    for i, group_options in enumerate(options):
        for key, value in group_options.items():
            config[f"param_groups[{i}].{key}"] = _canonical(value)
    group_of = {id(p): i for i, group in enumerate(groups) for p in group}
    layout = [
        (
            name,
            # under zero.Init a parameter holds its shard; ds_shape is the whole parameter's
            list(getattr(p, "ds_shape", p.shape)),
            str(p.dtype).removeprefix("torch."),
            bool(p.requires_grad),
            hasattr(p, "ds_tensor"),
            group_of.get(id(p)),
        )
        for name, p in model.named_parameters()
    ]
    return Setup(config, layout)


def agree(
    local: Setup | Exception,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    engine_group: dist.ProcessGroup | None = None,
) -> None:
    """Check that every rank's `Setup` matches; raise `RankMismatchError` on every rank if not.

    `local` is this rank's setup, or the error its preparation raised: that rank re-raises it
    and the others raise a `RankMismatchError` naming it. `group` is the data-parallel group
    (None: the world), within which the parameter layouts must match; `engine_group` holds
    every rank of the engine (None: the world), over which the configs must match. One
    all-gather of a few words when all match; nothing with one rank. [Note: agreement at
    initialize]
    """
    world = dist.get_world_size(engine_group)
    if world == 1:
        if isinstance(local, Exception):
            raise local
        return
    failed = isinstance(local, Exception)
    peers = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    words = [int(failed), min(peers)]
    if isinstance(local, Setup):
        words += _digest(local.config) + _digest(local.layout)
    else:
        words += [0, 0, 0, 0]
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    everyone = torch.empty(world * len(words), dtype=torch.int64, device=device)
    zcomm.all_gather_into_tensor(everyone, mine, group=engine_group)
    rows = [tuple(row) for row in everyone.view(world, len(words)).tolist()]
    if not _mismatch(rows):
        return
    # every rank saw the same rows, so every rank comes here: the details, once
    payload: Any = _error_text(local) if isinstance(local, Exception) else local
    gathered: list[Any] = [None] * world
    zcomm.all_gather_object(gathered, payload, group=engine_group)  # torch's needs NumPy
    if isinstance(local, Exception):
        raise local
    ranks = dist.get_process_group_ranks(engine_group) if engine_group is not None else None
    raise RankMismatchError(_problems(gathered, rows, ranks))


def _mismatch(rows: list[tuple[int, ...]]) -> bool:
    if any(row[0] for row in rows) or len({row[2:4] for row in rows}) > 1:
        return True
    layouts: dict[int, set[tuple[int, ...]]] = {}
    for row in rows:
        layouts.setdefault(row[1], set()).add(row[4:6])
    return any(len(digests) > 1 for digests in layouts.values())


def _problems(
    gathered: list[Any], rows: list[tuple[int, ...]], ranks: list[int] | None
) -> list[str]:
    """What differs, by global rank (`ranks`: the engine group's, None: the world's)."""
    rank_of = ranks or list(range(len(rows)))
    items = {rank_of[i]: item for i, item in enumerate(gathered)}
    failures = {r: text for r, text in items.items() if isinstance(text, str)}
    if failures:
        lines = [
            f"initialize: {_ranks(list(failures))} could not read the config or the model "
            "(the error below); every rank stops here rather than wait for them:"
        ]
        for rank, text in failures.items():
            lines += [f"  rank {rank}: {line}" for line in text.splitlines()]
        return lines
    setups: dict[int, Setup] = items
    lines = _config_lines(setups)
    by_group: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_group.setdefault(row[1], []).append(rank_of[i])
    several = len(by_group) > 1
    for members in by_group.values():
        prefix = f"(data-parallel {_ranks(members)}) " if several else ""
        lines += [prefix + line for line in _layout_lines({r: setups[r] for r in members})]
    header = (
        "initialize: the ranks were given different configs or models, and would hang or fail "
        "in the first collective that depends on them; every rank stops here. What differs:"
    )
    return [header, *("  " + line for line in lines)]


def _config_lines(setups: dict[int, Setup]) -> list[str]:
    keys: dict[str, None] = {}
    for setup in setups.values():
        keys.update(dict.fromkeys(setup.config))
    lines = []
    for key in sorted(keys):
        values = {r: _show(s.config.get(key, _NOT_SET)) for r, s in setups.items()}
        if len(set(values.values())) > 1:
            lines.append(f"config {key}: {_by_value(values)}")
    if len(lines) > _SHOWN_KEYS:
        lines = [*lines[:_SHOWN_KEYS], f"... and {len(lines) - _SHOWN_KEYS} more config keys"]
    return lines


def _layout_lines(setups: dict[int, Setup]) -> list[str]:
    tables = {r: {entry[0]: entry for entry in s.layout} for r, s in setups.items()}
    names: dict[str, None] = {}
    for setup in setups.values():
        names.update(dict.fromkeys(entry[0] for entry in setup.layout))
    differing = []
    for name in names:
        shown = {r: _entry(table.get(name)) for r, table in tables.items()}
        if len(set(shown.values())) > 1:
            differing.append(f"parameter {name!r}: {_by_value(shown)}")
    if not differing:
        orders = {r: [entry[0] for entry in s.layout] for r, s in setups.items()}
        if len({tuple(order) for order in orders.values()}) > 1:
            at = next(
                i for i in range(len(names)) if len({order[i] for order in orders.values()}) > 1
            )
            first = {r: repr(order[at]) for r, order in orders.items()}
            return [f"the parameters' order: parameter {at}: {_by_value(first)}"]
        return []
    count = len(differing)
    if count > _SHOWN_PARAMETERS:
        differing = [
            *differing[:_SHOWN_PARAMETERS],
            f"... and {count - _SHOWN_PARAMETERS} more parameters",
        ]
    return [f"{count} parameter(s) differ:", *("  " + line for line in differing)]


_NOT_SET = "(not set)"


def _entry(entry: tuple[str, list[int], str, bool, bool, int | None] | None) -> str:
    if entry is None:
        return "no such parameter"
    _, shape, dtype, requires_grad, partitioned, group = entry
    text = f"shape {tuple(shape)}, {dtype}, requires_grad={requires_grad}"
    if partitioned:
        text += ", built under zero.Init"
    return text + ("" if group is None else f", optimizer group {group}")


def _by_value(values: dict[int, str]) -> str:
    """``rank 0 has 2; ranks 1-3 have 4``: the ranks grouped by what they hold."""
    holders: dict[str, list[int]] = {}
    for rank, value in values.items():
        holders.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in holders.items():
        verb = "has" if len(ranks) == 1 else "have"
        parts.append(f"{_ranks(ranks)} {verb} {value}")
    return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return "ranks " + ", ".join(spans)


def _show(value: object) -> str:
    if value is _NOT_SET:
        return _NOT_SET
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _digest(value: object) -> list[int]:
    """Two int64 words of a blake2b over `value`'s canonical JSON."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    raw = hashlib.blake2b(text.encode(), digest_size=16).digest()
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8)]


def _is_local(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in _LOCAL_KEYS)


def _flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, item in value.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(item, Mapping) and item:
            flat.update(_flatten(item, path))
        else:
            flat[path] = _canonical(item)
    return flat


def _canonical(value: object) -> Any:
    """`value` as JSON can hold it, the same on every rank for the same value (an object's
    address, which differs between processes, never enters)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # inf: JSON has no literal
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, torch.Tensor):
        return _canonical(value.item()) if value.numel() == 1 else f"tensor{list(value.shape)}"
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_canonical(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, (torch.dtype, torch.device, os.PathLike)):
        return str(value)
    return type(value).__qualname__  # a callable or another object: its kind only


def _kind(optimizer: Any) -> str | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__qualname__
    return "a callable"
