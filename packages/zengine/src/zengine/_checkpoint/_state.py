"""What a checkpoint holds, as a flat DCP state dict keyed by parameter name.

Keys (see [Note: checkpoints keyed by parameter name]):

- ``master/<param>``: the fp32 master weights of a trainable parameter, flattened;
- ``optim/<param>/<state>``: its optimizer state (``exp_avg``...: flattened like the master;
  a 0-d state such as Adam's ``step``: whole, the same on every rank);
- ``model/<name>``: a frozen parameter (compute dtype) or a buffer, flattened;
- ``optim/param_groups``: the torch optimizer's group options (learning rates...);
- ``engine``: step counters, loss scaler and LR scheduler state;
- ``rank<r>/rng``, ``rank<r>/client_state``: what differs between ranks.

The same builders make the save source and the load destination: on load the values are views
of this rank's own tensors, so DCP reads straight into them.
"""

from __future__ import annotations

import contextlib
import importlib
import random
from collections.abc import Collection, Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, TensorStorageMetadata

from zengine._checkpoint._engine_view import CheckpointEngine, CheckpointOptimizer
from zengine._checkpoint._errors import CheckpointError
from zengine._checkpoint._pieces import Piece

__all__ = [
    "ENGINE",
    "PARAM_GROUPS",
    "after_load",
    "apply_engine_state",
    "apply_rng",
    "engine_state",
    "frozen_shards_in_memory",
    "model_entries",
    "optimizer_entries",
    "optimizer_of",
    "persistent_buffers",
    "rank_key",
    "rng_state",
]

ENGINE = "engine"
PARAM_GROUPS = "optim/param_groups"


def optimizer_of(engine: CheckpointEngine) -> CheckpointOptimizer:
    """The optimizer whose state is saved or loaded. A forward-only engine never asks: it
    saves and loads its weights alone (the engine refuses the rest before coming here)."""
    if engine.optimizer is None:
        raise CheckpointError(
            "this engine has no optimizer (it runs forward passes only): its checkpoints hold "
            "the weights alone"
        )
    return engine.optimizer


def after_load(engine: CheckpointEngine) -> None:
    """What a load does once the entries are read: the loaded masters into the parameters and
    no gradient left over; an engine without an optimizer (its shards read directly) releases
    what is gathered, so that the next forward gathers the loaded shards."""
    if engine.optimizer is None:
        if engine.partitioned is not None:
            engine.partitioned.release_all()
        return
    engine.optimizer.layout.write_back()  # the masters into the parameters (all-gathers)
    engine.optimizer.clear_grads()


def rank_key(rank: int, what: str) -> str:
    return f"rank{rank}/{what}"


def full_numel(p: torch.Tensor) -> int:
    """A parameter's element count, also when ZeRO-3 partitioned it (``p.data`` is empty)."""
    return int(getattr(p, "ds_numel", p.numel()))


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers ``module.state_dict()`` holds (not the non-persistent ones)."""
    for prefix, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def _valid(numel: int, param_offset: int, size: int) -> int:
    """Elements of a piece inside the parameter: a ZeRO-3 shard's padding lies beyond it."""
    return max(0, min(numel, size - param_offset))


@contextlib.contextmanager
def frozen_shards_in_memory(engine: CheckpointEngine) -> Iterator[None]:
    """The ZeRO-3 shards of frozen parameters in memory while a checkpoint reads or writes
    them, put away after: a shard kept as int8 codes (``zero_quantized_nontrainable_weights``)
    is dequantized into its storage, and quantized again after a load only if its values
    changed; one offloaded to NVMe is read back, and rewritten if written."""
    handle = engine.partitioned
    if handle is None:
        yield
        return
    units = {
        id(p.ds_unit): p.ds_unit
        for p in engine.module.parameters()
        if not p.requires_grad and hasattr(p, "ds_unit")
    }
    frozen = list(units.values())
    handle.fetch_shards(frozen)
    try:
        yield
    finally:
        handle.evict_shards(frozen)


def model_entries(
    engine: CheckpointEngine, exclude_frozen: bool = False, saved_masters: Collection[str] = ()
) -> dict[str, Piece]:
    """The masters of trainable parameters, frozen parameters (not with `exclude_frozen`) and
    buffers, as this rank's pieces (views: written into on load). An engine without an
    optimizer has no masters: its parameters themselves are the pieces, under the keys of the
    checkpoint's masters for the names in `saved_masters`."""
    parts = engine.optimizer.partitions if engine.optimizer is not None else None
    # a shard's index: in the shard group with hybrid sharding (its replicas hold the same)
    shards = engine.optimizer.shard_group if engine.optimizer is not None else engine.group
    rank = dist.get_rank(shards)
    entries: dict[str, Piece] = {}
    for name, p in engine.module.named_parameters():
        size = full_numel(p)
        frag = parts.fragments.get(id(p)) if parts is not None else None
        master = parts.master_of(p) if parts is not None else None  # with a fragment, one
        kind = "master" if parts is None and name in saved_masters else "model"
        if frag is not None and master is not None:
            valid = _valid(frag.numel, frag.param_offset, size)
            entries[f"master/{name}"] = Piece(master[:valid], min(frag.param_offset, size), size)
        elif exclude_frozen:
            continue
        elif hasattr(p, "ds_tensor"):  # a frozen ZeRO-3 parameter: its shard
            shard = p.ds_tensor
            offset = min(rank * shard.numel(), size)
            entries[f"{kind}/{name}"] = Piece(
                shard[: _valid(shard.numel(), offset, size)], offset, size
            )
        else:  # a frozen parameter at stages 0-2: whole on every rank
            entries[f"{kind}/{name}"] = Piece(p.data.view(-1), 0, size)
    for name, buf in persistent_buffers(engine.module):
        entries[f"model/{name}"] = Piece(buf.data.view(-1), 0, buf.numel())
    return entries


class _ParamState(NamedTuple):
    name: str
    stepped: torch.Tensor  # the tensor the optimizer steps for the parameter
    offset: int  # the piece's offset in `stepped`
    param_offset: int  # the piece's offset in the flattened parameter
    valid: int  # the piece's length (padding left out)
    size: int  # the parameter's full element count
    state: dict[Any, Any]  # the optimizer's state of `stepped`


def _param_states(engine: CheckpointEngine) -> Iterator[_ParamState]:
    """This rank's piece of every trainable parameter, with its optimizer state."""
    optimizer = optimizer_of(engine)
    parts, state = optimizer.partitions, optimizer.optimizer.state
    for name, p in engine.module.named_parameters():
        key = parts.state_key(p)
        if key is None:
            continue
        stepped, offset = key
        frag = parts.fragments[id(p)]
        size = full_numel(p)
        valid = _valid(frag.numel, frag.param_offset, size)
        param_offset = min(frag.param_offset, size)
        yield _ParamState(name, stepped, offset, param_offset, valid, size, state[stepped])


def optimizer_entries(engine: CheckpointEngine) -> dict[str, Any]:
    """This rank's optimizer state by parameter name (views of the live state)."""
    entries: dict[str, Any] = {}
    for ps in _param_states(engine):
        for k, v in ps.state.items():
            key = f"optim/{ps.name}/{k}"
            if isinstance(v, torch.Tensor) and v.shape == ps.stepped.shape:
                piece = v[ps.offset : ps.offset + ps.valid]
                entries[key] = Piece(piece, ps.param_offset, ps.size)
            else:
                entries[key] = v  # a 0-d tensor or a number, the same on every rank
    entries[PARAM_GROUPS] = [
        {k: v for k, v in g.items() if k != "params"} for g in optimizer_of(engine).param_groups
    ]
    return entries


def optimizer_destinations(
    engine: CheckpointEngine, stored: Mapping[str, STORAGE_TYPES]
) -> dict[str, Any]:
    """Where the checkpoint's optimizer state goes: the live state, created where the
    optimizer has not stepped yet (a fresh engine), shaped as `stored` (a checkpoint's DCP
    metadata by key) says."""
    objects: dict[str, Any] = {}
    states = list(_param_states(engine))
    pieces: dict[int, list[tuple[int, int]]] = {}  # id(stepped) -> its pieces (offset, length)
    for ps in states:
        pieces.setdefault(id(ps.stepped), []).append((ps.offset, ps.valid))
    for ps in states:
        prefix, st = f"optim/{ps.name}/", ps.state
        missing = [key for key in stored if key.startswith(prefix) and key[len(prefix) :] not in st]
        # made in the order torch's optimizers make their state (numbers and 0-d tensors, the
        # step, first, then the rest by name: Adam's step, exp_avg, exp_avg_sq); the metadata
        # of a checkpoint several ranks wrote keeps no order
        missing.sort(key=lambda key: (not _scalar(stored[key]), key))
        for key in missing:
            k, md = key[len(prefix) :], stored[key]
            if not isinstance(md, TensorStorageMetadata):
                st[k] = None  # holds its place; apply_optimizer_objects puts the value
                objects[key] = None  # a number (an optimizer's own int step, say): DCP sets it
                continue
            dtype = md.properties.dtype
            if tuple(md.size) == (ps.size,):
                st[k] = _empty_but_gaps(ps.stepped, dtype, pieces[id(ps.stepped)])
            else:
                st[k] = torch.zeros(tuple(md.size), dtype=dtype, device=ps.stepped.device)
    return {k: v for k, v in optimizer_entries(engine).items() if k in stored} | objects


def _empty_but_gaps(
    like: torch.Tensor, dtype: torch.dtype, pieces: list[tuple[int, int]]
) -> torch.Tensor:
    """A tensor like `like` whose elements outside `pieces` (padding, alignment gaps) are 0,
    and the rest left to the load that writes every piece: zeroing a model's optimizer state
    before overwriting it took a second of a 245 M model's load."""
    out = torch.empty_like(like, dtype=dtype)
    flat, end = out.view(-1), 0
    for offset, length in sorted(pieces):
        flat[end:offset].zero_()
        end = max(end, offset + length)
    flat[end:].zero_()
    return out


def _scalar(md: Any) -> bool:
    return not isinstance(md, TensorStorageMetadata) or len(md.size) == 0


def apply_optimizer_objects(engine: CheckpointEngine, loaded: dict[str, Any]) -> None:
    """Put back what DCP loaded as objects (group options, non-tensor state)."""
    for g, options in zip(optimizer_of(engine).param_groups, loaded[PARAM_GROUPS], strict=True):
        g.update({k: v for k, v in options.items() if k != "params"})
    objects: dict[str, dict[str, Any]] = {}  # parameter name -> its state's loaded objects
    for key, value in loaded.items():
        if key == PARAM_GROUPS or isinstance(value, (torch.Tensor, Piece, type(None))):
            continue
        if key.startswith("optim/"):
            name, _, k = key.removeprefix("optim/").rpartition("/")
            objects.setdefault(name, {})[k] = value
    for ps in _param_states(engine):
        ps.state.update(objects.get(ps.name, {}))


def engine_state(engine: CheckpointEngine) -> dict[str, Any]:
    optimizer = optimizer_of(engine)
    scaler, scheduler = optimizer.loss_scaler, engine.lr_scheduler
    return {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": optimizer.skipped_steps,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
    }


def apply_engine_state(engine: CheckpointEngine, state: dict[str, Any], *, scheduler: bool) -> None:
    engine.global_steps = int(state["global_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.micro_steps = int(state["micro_steps"])
    optimizer = optimizer_of(engine)
    optimizer.skipped_steps = int(state["skipped_steps"])
    scaler = optimizer.loss_scaler
    if scaler is not None and state["loss_scaler"] is not None:
        scaler.load_state_dict(state["loss_scaler"])
    if scheduler and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])


def _numpy() -> Any:
    """NumPy's module where it is installed (its global RNG is restored too), else None."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def rng_state() -> dict[str, Any]:
    """Every random generator training may draw from (dropout, sampling, shuffling)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy()
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def apply_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = _numpy()
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])
