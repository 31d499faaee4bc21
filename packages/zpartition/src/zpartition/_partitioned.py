"""`partition`: make a built model's parameters ZeRO-3 parameters and install the hooks."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zcomm
from zpartition._channel import Kind
from zpartition._config import ZeroParamConfig
from zpartition._coordinator import Coordinator
from zpartition._errors import ZeroParamError
from zpartition._external import ParamDict, external_parameters
from zpartition._gather import bind_gather_methods, channel_for, new_unit
from zpartition._gathered import GatheredParameters
from zpartition._hooks import ModuleInfo, State, eager
from zpartition._hybrid import replicas_for
from zpartition._leaf import leaf_modules_by_granularity, z3_leaf_module
from zpartition._module_groups import module_groups
from zpartition._param import (
    ZeroParameter,
    convert_parameter,
    next_module_id,
    partitioned,
    zero_params,
)
from zpartition._partial import PartialGradients, node_split
from zpartition._reduce import GradientSink
from zpartition._secondary import secondary_channel
from zpartition._status import ZeroParamStatus
from zpartition._store import ShardStore
from zpartition._unit import Unit, fetch_shards

__all__ = ["Partitioned", "convert_module", "partition"]


# bytes from which a tensor is broadcast in place, not copied into one flat buffer; smaller
# ones (biases, norms) share one collective, whose latency would dwarf their copy
_OWN_BROADCAST = 1 << 20


def _broadcast_params(params: list[ZeroParameter], group: dist.ProcessGroup | None) -> None:
    """Make `params` equal on every rank (rank 0's values): ranks built them with their own RNG.
    Large tensors are broadcast in place, the others flattened together per dtype (one
    collective): the flat copy and the copy back of every tensor were a third of `Init`'s
    construction time on CPU (a 245 M Llama at 2 ranks, 3.9 s -> 2.5 s) and one more module
    resident at its peak."""
    if dist.get_world_size(group) == 1 or not params:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    by_dtype: dict[torch.dtype, list[ZeroParameter]] = {}
    for p in params:
        if p.data.is_contiguous() and p.numel() * p.element_size() >= _OWN_BROADCAST:
            zcomm.broadcast(p.data, src, group=group)
        else:
            by_dtype.setdefault(p.dtype, []).append(p)
    for same in by_dtype.values():
        flat = torch.cat([p.data.reshape(-1) for p in same])
        zcomm.broadcast(flat, src, group=group)
        offset = 0
        for p in same:
            p.data.copy_(flat[offset : offset + p.numel()].view_as(p.data))
            offset += p.numel()


def convert_module(
    module: nn.Module,
    *,
    group: dist.ProcessGroup | None,
    recurse: bool,
    shard_device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    pin_memory: bool = False,
    sync: bool = True,
    replicate: dist.ProcessGroup | None = None,
) -> list[ZeroParameter]:
    """Partition the parameters of `module` not partitioned yet; returns them. `pin_memory`:
    host shards in pinned memory where CUDA is there (they copy to the GPU asynchronously).
    `sync`: make them rank 0's first (replica 0's too, with a `replicate` group: [Note: hybrid
    sharding]); without, each rank keeps its own values' chunk."""
    found = [p for p in module.parameters(recurse=recurse) if not hasattr(p, "ds_id")]
    for p in found:
        if p.numel() == 0 and dtype is not None and p.is_floating_point():
            p.data = p.data.to(dtype)  # left whole (see `partitioned`), in the compute dtype
    fresh = zero_params({id(p): p for p in found if p.numel() > 0}.values())
    if sync:
        if replicate is not None:
            _broadcast_params(fresh, replicate)
        _broadcast_params(fresh, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    channel = channel_for(group)
    for p in fresh:
        where = shard_device or p.device
        convert_parameter(
            p,
            ds_id=channel.next_param_id(),
            rank=rank,
            world=world,
            shard_device=where,
            compute_device=p.device,
            dtype=dtype,
            pin=pin_memory and where.type == "cpu" and torch.cuda.is_available(),
        )
        bind_gather_methods(p)
    return fresh


def _persistent(module: nn.Module, config: ZeroParamConfig) -> set[int]:
    """ds_ids of the parameters that stay gathered, in model order until the total is spent."""
    chosen: set[int] = set()
    total = 0
    for p in partitioned(module.parameters()):
        if p.ds_numel <= config.param_persistence_threshold and (
            total + p.ds_numel <= config.model_persistence_threshold
        ):
            chosen.add(p.ds_id)
            total += p.ds_numel
            p.ds_persist = True
    return chosen


def _walk(
    module: nn.Module, groups: set[nn.Module], prefix: str = ""
) -> Iterator[tuple[str, nn.Module, bool]]:
    """(name, module, gathered whole) in pre-order, not entering leaf modules and groups."""
    whole = module in groups or z3_leaf_module(module)
    yield prefix, module, whole
    if whole:
        return
    for name, child in module.named_children():
        yield from _walk(child, groups, f"{prefix}.{name}" if prefix else name)


class Partitioned:
    """A model whose parameters are partitioned, with its hooks; returned by `partition`.

    Train it with any torch optimizer over `shard_parameters` (each rank steps its own shards);
    ``remove()`` gathers the full parameters back and takes the hooks off.
    """

    def __init__(self, module: nn.Module, config: ZeroParamConfig, state: State) -> None:
        self.module = module
        self.config = config
        self._state = state

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same shards in the other shard groups, across which gradients
        are all-reduced (see `partition`); None without replicas (or a group of one rank)."""
        replicas = self._state.replicas
        return None if replicas is None else replicas.group

    @property
    def secondary_group(self) -> dist.ProcessGroup | None:
        """This rank's secondary group (``ZeroParamConfig.secondary_partition_size``
        consecutive ranks within a node), where the backward gathers what the forward's
        gathers kept ([Note: secondary partition]); None without a secondary partition."""
        units = self._state.coordinator.units.values()
        hpz = next((u.hpz for u in units if u.hpz is not None), None)
        return None if hpz is None else hpz.group

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """Whether the next backward passes all-reduce the gradients across the replicate group
        (FSDP2's switch for HSDP; True at first). While False, each backward only
        reduce-scatters within the shard group and the results are held apart; the first
        backward with True all-reduces everything held, once, at its end, and adds it to the
        shards' ``.grad``: set it False for all but the last micro-batch of an accumulation,
        as DeepSpeed's MiCS all-reduces at the accumulation boundary only. No effect without
        replicas, or with a gradient sink (its owner all-reduces: `all_reduce_replicas`).
        With ``ZeroParamConfig.node_local_accumulation`` it says likewise which backward
        reduce-scatters the node's held gradients across the nodes, sink or not ([Note:
        node-local accumulation])."""
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(
                f"set_requires_all_reduce: expected a bool, got {requires_all_reduce!r}"
            )
        self._state.requires_all_reduce = requires_all_reduce

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether the next backward passes reduce the gradients across ranks (FSDP2's switch;
        True at first). While False, each backward keeps its full gradients, summed in the
        reduction dtype, and reduces nothing; the first backward with True (or
        `sync_gradients`) reduces them with its own, once: an accumulation's gradients then
        cross the ranks, and the nodes, at its end only, for a full gradient's memory per rank.
        Set it False for all but the last micro-batch. With one rank it changes nothing. See
        [Note: gradient sync]."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                f"set_requires_gradient_sync: expected a bool, got {requires_gradient_sync!r}"
            )
        self._state.requires_gradient_sync = requires_gradient_sync

    def sync_gradients(self) -> None:
        """Reduce the gradients that backward passes without gradient sync held, now, as the
        next backward with sync would: into the shards' ``.grad`` or the gradient sink (with
        replicas and no sink, all-reduced across them too). Every rank calls it; nothing
        happens where nothing is held."""
        self._state.sync_gradients()

    def drop_unsynced_gradients(self) -> None:
        """Forget the gradients held by backward passes without gradient sync (a ``zero_grad``
        inside an accumulation)."""
        self._state.drop_unsynced()

    def all_reduce_replicas(self, tensors: Sequence[torch.Tensor]) -> None:
        """The replicas' stage of the gradient reduction on `tensors`, in place: for the owner
        of a gradient sink, which gets only the shard group's reduction (the mean over the shard
        group, or with ``reduce_scale`` the sum pre-scaled), to all-reduce its accumulated
        gradients at its step. The mean over the replicas, or with ``reduce_scale`` the sum
        times the post-factor. Nothing without replicas. Every rank of the replicate group
        calls it with tensors of the same sizes."""
        replicas = self._state.replicas
        if replicas is not None:
            replicas.all_reduce(tensors)

    @property
    def coordinator(self) -> Coordinator:
        """The prefetching coordinator (traces, invalidation count)."""
        return self._state.coordinator

    @property
    def units(self) -> list[Unit]:
        """Every unit of communication, in model order (the persistent one last)."""
        units = list(self._state.coordinator.units.values())
        if self._state.persistent is not None:
            units.append(self._state.persistent)
        return units

    def shard_parameters(self) -> list[torch.Tensor]:
        """This rank's shard (``ds_tensor``) of every trainable parameter: what to optimize."""
        seen: dict[int, torch.Tensor] = {}
        for p in partitioned(self.module.parameters()):
            if p.requires_grad:
                seen.setdefault(p.ds_id, p.ds_tensor)
        return list(seen.values())

    def take_written(self) -> list[ZeroParameter]:
        """The parameters whose shard was written through ``param.ds_tensor.data = t`` or
        ``param.ds_tensor.copy_(t)`` since the last call, once each, in ``ds_id`` order (see
        [Note: shard writes]). The gathers already return the written values; an optimizer
        keeping fp32 masters apart from the shards re-reads these masters from their shards
        before its next step, or the step would write the old values back."""
        written = self._state.written
        if not written:
            return []
        found = {p.ds_id: p for p in written}
        written.clear()
        return [found[k] for k in sorted(found)]

    def set_gradient_sink(self, sink: GradientSink | None) -> None:
        """Hand reduced shard gradients to `sink` from now on (None: ``ds_tensor.grad``). With
        replicas the sink gets the shard group's reduction, and its owner all-reduces across
        `replicate_group` (`all_reduce_replicas`)."""
        self._state.sink = sink

    @property
    def grad_buffers(self) -> list[torch.Tensor]:
        """The gradient buckets kept between passes (``persistent_grad_buckets``), one per
        dtype; empty until the first backward, and without that option."""
        return list(self._state.grad_buffers.values())

    def set_shard_store(self, store: ShardStore | None) -> None:
        """Keep the shards of released units in `store` (see `ShardStore`); the persistent
        unit's stay in memory. Released units' shards go there now."""
        for u in self.units:
            if u.persistent or u.codes is not None:  # codes: [Note: quantized frozen weights]
                continue
            if u.store is not None and store is not u.store:
                u.store.fetch([u.shard])
            u.store = store
            if store is not None and u.status is ZeroParamStatus.NOT_AVAILABLE:
                store.evict(u.shard)
        if store is not None:
            self._state.shards_stored()

    def fetch_shards(self, units: Sequence[Unit] | None = None) -> None:
        """The shards of `units` (default: every unit) in memory, to read them or write into
        them as an optimizer step does: from their store, or their codes ([Note: quantized
        frozen weights])."""
        fetch_shards(self.units if units is None else units)

    def evict_shards(self, units: Sequence[Unit] | None = None) -> None:
        """The shards of released units (of `units`, default: every unit) back to their store
        or codes (after `fetch_shards`)."""
        for u in self.units if units is None else units:
            if u.status is ZeroParamStatus.NOT_AVAILABLE:
                u.put_away()

    @property
    def peak_live_numel(self) -> int:
        """The most elements of non-persistent parameters gathered at once since `reset_peak`."""
        return self._state.channel.peak_live_numel

    def reset_peak(self) -> None:
        channel = self._state.channel
        channel.peak_live_numel = channel.live_numel

    def agree_on_step(self) -> None:
        """Block until every rank of the group begins an optimizer step; raise
        `ZeroParamError` on every rank, naming each one's engine call and step, if a rank is
        elsewhere (gathering for a forward, reducing in a backward) ([Note: agreement])."""
        self._state.channel.agree(Kind.STEP, [])

    def release_all(self, *, persistent: bool = True) -> None:
        """Release every gathered parameter, the persistent ones too unless `persistent` is
        False (DeepSpeed's ``empty_partition_cache``): the next forward or backward gathers
        what it needs. Secondary shards go too ([Note: secondary partition]): a backward still
        to come gathers from the primary shards."""
        self._state.coordinator.release_all()
        self._state.coordinator.drop_secondaries()
        if persistent and self._state.persistent is not None:
            self._state.persistent.release()

    @contextlib.contextmanager
    def unhooked(self) -> Iterator[None]:
        """Inside, every parameter is gathered and the modules' hooks are off: forward passes
        run as on a plain model, with no fetch or release per module (generation, token after
        token; DeepSpeed's ``unwrap_model_for_generation``). Changes to the parameters inside
        are dropped. Every rank must enter it; the parameters are released at the end."""
        with GatheredParameters(list(self.module.parameters())):
            self.unhook_forward()
            try:
                yield
            finally:
                self.hook_forward()

    @property
    def forward_hooked(self) -> bool:
        """Whether the modules' forward hooks are on (`unhook_forward` takes them off)."""
        return self._state.forward_hooked

    def unhook_forward(self) -> None:
        """Take the modules' forward hooks off, as `unhooked` does, for callers that pair the
        two halves themselves (TRL removes DeepSpeed's hooks inside ``GatheredParameters`` and
        adds them back later): forward passes then neither gather nor release, so the
        parameters must be gathered around them. Nothing happens if they are off already."""
        if self._state.forward_hooked:
            self._state.unhook_forward()

    def hook_forward(self) -> None:
        """Put the forward hooks back; nothing happens if they are on."""
        if not self._state.forward_hooked:
            self._state.hook_forward()

    def remove(self, *, gather: bool = True) -> None:
        """Take the hooks off. With `gather` (the default) make the model plain again: full
        parameters in ``param.data`` on every rank, no ``ds_*`` attributes; without, leave the
        parameters partitioned (for a model about to be dropped). Every rank must call it."""
        for handle in self._state.handles:
            handle.remove()
        self._state.handles.clear()
        self._state.coordinator.drop_secondaries()
        for m in self.module.modules():
            if isinstance(m._parameters, ParamDict):
                m._parameters = dict(m._parameters)
            m.__dict__.pop("_zp_on_externals_changed", None)
            m.__dict__.pop("ds_external_parameters", None)
            if gather:
                m.__dict__.pop("_external_params", None)
        self.module.__dict__.pop("forward", None)
        if gather:
            for unit in self.units:
                self._unpartition(unit)

    @staticmethod
    def _unpartition(unit: Unit) -> None:
        unit.make_exact()  # the parameters keep these values: not a pass's narrowed ones
        if unit.persistent:
            unit.refresh()  # gathered, but maybe before the optimizer's last step
        elif unit.status is not ZeroParamStatus.AVAILABLE:
            unit.channel.agree(Kind.GATHER, [unit.uid])
            unit.issue_gather()
            unit.wait()
        for p, view in zip(unit.params, unit.views, strict=True):
            p.data = view.clone()
            for name in [k for k in p.__dict__ if k.startswith("ds_")] + _METHODS:
                p.__dict__.pop(name, None)


_METHODS = ["all_gather", "partition"]  # bound by convert_module (ds_summary is a ds_*)


def partition(
    module: nn.Module,
    *,
    config: ZeroParamConfig | None = None,
    group: dist.ProcessGroup | None = None,
    gradient_sink: GradientSink | None = None,
    shard_device: torch.device | None = None,
    pin_memory: bool = False,
    replicate_group: dist.ProcessGroup | None = None,
) -> Partitioned:
    """Partition `module`'s parameters across `group` (the world by default) and hook it.

    Parameters built under `Init` keep their shards; others are made equal to rank 0's and cut
    here. Modules then gather their parameters to run forward and backward and release them
    after; each rank's averaged gradients land in ``ds_tensor.grad``, or are handed to
    `gradient_sink` (an optimizer keeping its own fp32 gradients does that). `shard_device` is
    where the shards of parameters cut here live (their own device by default; the host for
    parameter offload: each all-gather then copies the shard to the compute device first);
    `pin_memory` pins such host shards where CUDA is there, so those copies run asynchronously.

    `replicate_group`: hybrid sharding (DeepSpeed's MiCS, FSDP2's HSDP). `group` is then this
    rank's shard group and `replicate_group` the ranks with the same index in the other shard
    groups; the groups must form a grid of the world (`ZeroParamError` otherwise). Parameters
    are made global rank 0's, cut within the shard group, and gradients reduce-scattered
    there, then all-reduced across the replicas at the end of a backward
    (`Partitioned.set_requires_all_reduce`); see [Note: hybrid sharding]. Parameters built
    under `Init` must have been built with the same `replicate_group`.

    ``config.secondary_partition_size`` S > 1: ZeRO++'s hpZ (FSDP2's
    ``reshard_after_forward=S``): a forward's gather keeps 1/S of each unit on this rank until
    its backward, which gathers it within a group of S consecutive ranks of `group` on one node
    ([Note: secondary partition]); with `replicate_group`, within the shard group. S must divide
    a node's ranks (`zcomm.node_layout`) and `group`'s size, each secondary group must lie on
    one node (`ZeroParamError` otherwise), and every rank of the world partitions at once (the
    secondary groups are built by all).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"partition: module must be an nn.Module, got {type(module).__name__}")
    config = config or ZeroParamConfig()
    if not dist.is_initialized():
        zcomm.init_distributed()
    replicate = replicas_for(group, replicate_group)
    _check_replicas_of_init(module, replicate)
    # before anything is cut: a size that does not fit leaves the model as it was
    hpz = secondary_channel(channel_for(group), config.secondary_partition_size)
    split = node_split(group, replicate) if config.node_local_accumulation else None
    if config.quantized_nontrainable_weights:
        _check_frozen_finite(module)
    convert_module(
        module,
        group=group,
        recurse=True,
        shard_device=shard_device,
        pin_memory=pin_memory,
        replicate=replicate,
    )
    if config.module_granularity_threshold:
        leaf_modules_by_granularity(module, config.module_granularity_threshold)
    channel = channel_for(group)
    persistent_ids = _persistent(module, config)
    for name, p in module.named_parameters():
        p.ds_name = name  # type: ignore[attr-defined]
    infos, units = _build_units(module, channel, persistent_ids, config)
    persistent = _persistent_unit(module, channel, persistent_ids)
    for unit in [*units, *([persistent] if persistent is not None else [])]:
        unit.replicate = replicate
    for unit in units:  # the persistent unit is never released: it needs none
        unit.hpz = None if unit.direct else hpz
    if config.quantized_nontrainable_weights:  # [Note: quantized frozen weights]
        for unit in units:
            if not unit.trainable and unit.quantizable is not None:
                unit.store_quantized(config.quantized_weights_block_size)
    coordinator = Coordinator(config, channel, units)
    state = State(module, infos, coordinator, persistent, channel)
    state.sink = gradient_sink
    state.units = [u for u in units if u.trainable]
    if persistent is not None and persistent.trainable:
        state.units.append(persistent)
    device = state.units[0].device if state.units else torch.device("cpu")
    held = (state.units, config.reduce_dtype, config.reduce_scale, device)
    if replicate is not None:
        state.replicas = PartialGradients(replicate, *held)
    if split is not None:
        across, state.node_split = split
        state.node_local = PartialGradients(across, *held, rows=split[1][1])
    if config.quantized_gradients:
        # hierarchical over the nodes for a model partitioned across the world (group None) of
        # several; within a shard group or a node (hybrid, node-local accumulation) flat
        hierarchical = group is None and split is None and zcomm.node_layout().nodes > 1
        state.quantize = (config.quantized_weights_block_size, hierarchical)
    reader = eager(state.read)  # a read through another module's attribute gathers
    for info in infos.values():
        for m in info.members:  # a group's or leaf's modules too: [Note: module groups]
            if not isinstance(m._parameters, ParamDict):
                m._parameters = ParamDict(m._parameters, info, state.stack, reader)
    for m in module.modules():  # DeepSpeed's method, which tools iterate with named_parameters
        m.__dict__["ds_external_parameters"] = functools.partial(external_parameters, m)
    state.install()
    _guard_forward(module, state)
    return Partitioned(module, config, state)


def _check_frozen_finite(module: nn.Module) -> None:
    """Frozen weights to be kept as codes must be finite: no scale represents NaN or inf
    ([Note: quantized frozen weights])."""
    for name, p in module.named_parameters():
        if p.requires_grad or not p.is_floating_point():
            continue
        values = getattr(p, "ds_tensor", p).detach()
        bad = int((~torch.isfinite(values)).sum())
        if bad:
            raise ZeroParamError(
                f"partition(quantized_nontrainable_weights=True): frozen parameter {name!r} has "
                f"{bad} non-finite value(s) (NaN or inf), which int8 codes cannot hold"
            )


def _check_replicas_of_init(module: nn.Module, replicate: dist.ProcessGroup | None) -> None:
    """Parameters built under `Init` were made equal across its replicate group, or not: with
    another one here, the replicas would train apart without a word."""
    for name, p in module.named_parameters():
        unit = getattr(p, "ds_unit", None)
        if unit is not None and unit.replicate is not replicate:
            said = "no replicate_group" if unit.replicate is None else "another replicate_group"
            raise ZeroParamError(
                f"partition: parameter {name!r} was built under Init with {said} than the "
                "replicate_group given here; pass the same one to both"
            )


def _device_of(params: list[ZeroParameter]) -> torch.device:
    return params[0].data.device


def _build_units(
    module: nn.Module, channel: Any, persistent_ids: set[int], config: ZeroParamConfig
) -> tuple[dict[nn.Module, ModuleInfo], list[Unit]]:
    owned: dict[int, Unit] = {}
    infos: dict[nn.Module, ModuleInfo] = {}
    units: list[Unit] = []
    needs_hooks = _subtrees_with_partitioned(module, persistent_ids)
    limit = min(config.module_group_size, config.max_live_parameters // 2)
    groups = module_groups(module, limit, persistent_ids)
    for name, m, whole in _walk(module, groups):
        if m not in needs_hooks and m is not module:  # the root begins every pass
            continue
        params = partitioned(m.parameters(recurse=whole))
        mine = [p for p in params if p.ds_id not in owned and p.ds_id not in persistent_ids]
        mine = list({p.ds_id: p for p in mine}.values())
        own: list[Unit] = []
        # a leaf's or group's frozen parameters apart ([Note: module groups]): a unit's
        # backward ends when its last gradient arrives, before frozen layers beside it are
        # done; and they can be kept as codes. A unit per module is one or the other already
        for part in filter(None, _by_trainable(mine) if whole else [mine]):
            unit = new_unit(
                channel.next_unit_id(), name or "<root>", part, channel, _device_of(part)
            )
            units.append(unit)
            own.append(unit)
            for p in part:
                owned[p.ds_id] = unit
                if whole and m not in groups:
                    p.ds_z3_leaf_module = m
        externals = m.__dict__.setdefault("_external_params", {})
        for p in params:
            if p.ds_id in owned and owned[p.ds_id] not in own:
                externals[p.ds_id] = p  # tied: another module's unit holds it
        members = tuple(m.modules()) if whole else (m,)
        infos[m] = ModuleInfo(m, next_module_id(), name, tuple(own), members)
    return infos, units


def _by_trainable(params: list[ZeroParameter]) -> list[list[ZeroParameter]]:
    """`params` as the trainable ones and the frozen ones."""
    return [[p for p in params if p.requires_grad], [p for p in params if not p.requires_grad]]


def _subtrees_with_partitioned(module: nn.Module, persistent_ids: set[int]) -> set[nn.Module]:
    found: set[nn.Module] = set()
    for m in module.modules():
        if any(p.ds_id not in persistent_ids for p in partitioned(m.parameters())):
            found.add(m)
    return found


def _persistent_unit(module: nn.Module, channel: Any, persistent_ids: set[int]) -> Unit | None:
    params = [p for p in partitioned(module.parameters()) if p.ds_id in persistent_ids]
    if not params:
        return None
    unit = new_unit(channel.next_unit_id(), "<persistent>", params, channel, _device_of(params))
    unit.persistent = True
    unit.refresh()
    return unit


def _guard_forward(module: nn.Module, state: State) -> None:
    """Wrap the root's forward so an error from an unavailable parameter names it."""
    forward = module.forward

    @functools.wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except Exception as error:
            named = state.diagnose(error)
            if named is None:
                raise
            raise named from error

    module.forward = guarded
