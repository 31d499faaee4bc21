"""``engine.offload_states`` / ``reload_states``, `get_state_devices` and `memory_held`, on
zoffload.

Each of DeepSpeed's five state types names the tensors the engine holds for it. Offloading moves
their storages (zoffload empties the same storage objects the optimizer and the model point at,
so no reference goes stale) to host memory or to NVMe files; reloading fills them again,
bit-exact. Two types can share storage (fp32 parameters are their own masters: ``hp_params``
and ``lp_params`` are then the same bytes), which moves once.

[Note: offload_states' footprint]
What an RLHF job needs (the trainer hands its memory to an inference engine between steps, and
gets the same training state back, cycle after cycle): after ``offload_states()`` of every
state, the engine holds nothing on its device, and after ``reload_states()`` exactly what it
held before. Which ``include`` name covers which buffer:

- ``optim_states``: the optimizer's state tensors (Adam's moments); scalar step counts stay.
- ``hp_params``: the fp32 master partitions (the parameters themselves where they are fp32).
- ``lp_params``: the compute-dtype parameters: at stage 3 the shards and the persistent
  parameters' gathered copies, at stages 0-2 the flat buffers the module's parameters view.
- ``lp_grads``: the gradient partitions (``grad_partitions_flat_buffer``) and at stages 0-2 the
  full and low-precision gradient flats.
- ``contiguous_grad_buffer``: the gradient buckets kept between passes (on a GPU, or where the
  config names ``contiguous_gradients``); freed, not copied, as DeepSpeed does, and given
  back (uninitialised) at reload.
- Whatever state is named, ZeRO-3's gathered parameters and prefetches are released first;
  stages 0-2 gather nothing, reduce into the gradient flats and keep no communication buffers
  between passes; an optimizer step keeps no scratch space. So the five names cover every
  byte (`memory_held` shows it; the tests count every storage left).

Two rules keep the footprint exact. Offloading to ``cpu`` a state already on the host does
nothing to it (no copy, no pool; DeepSpeed's ``.to("cpu")`` of a host tensor is a no-op): on
a CPU engine only ``nvme`` frees memory. And a reload gives back what it used on the way: the
host copies and NVMe staging buffers go back to the system (zoffload's pool is trimmed), and
storages whose pages were not resident (zero pages, zoffload's [Note: zero pages]) come back
not resident. While a state is offloaded, the engine refuses the calls that would read it
(`StateOffloader.require`) instead of crashing on an emptied storage; a forward needs only the
parameters, so generation with the optimizer state away works, as DeepSpeed-Chat's does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

import zoffload
import zpartition
from zengine._errors import UsageError
from zengine._offload._agree import agree_on_folders, agree_on_outcome
from zoffload import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = [
    "StateOffloader",
    "StatesEngine",
    "StatesOptimizer",
    "get_state_devices",
    "memory_held",
]


# What offload_states reads of an engine and its ZeRO optimizer, both a layer above: `Engine`
# and `ZeroOptimizer` satisfy these (tests/test_checkpoint_engine_view.py checks them).
class _Partitions(Protocol):
    @property
    def fp32_partitions_flat(self) -> torch.Tensor | None: ...
    @property
    def grad_partitions_flat_buffer(self) -> torch.Tensor: ...


class _Layout(Protocol):
    @property
    def flats(self) -> Sequence[torch.Tensor]: ...
    @property
    def grad_flats(self) -> Sequence[torch.Tensor]: ...
    @property
    def low_grad_flats(self) -> Sequence[torch.Tensor]: ...


@runtime_checkable
class StatesOptimizer(Protocol):
    """The ZeRO optimizer's tensors that offload_states moves."""

    @property
    def partitions(self) -> _Partitions: ...
    @property
    def layout(self) -> _Layout: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    def resident(self) -> StatesOptimizer: ...
    def stepped_tensors(self) -> list[torch.Tensor]: ...


@runtime_checkable
class StatesEngine(Protocol):
    """The engine as offload_states, get_state_devices and memory_held read it."""

    @property
    def optimizer(self) -> StatesOptimizer | None: ...
    @property
    def partitioned(self) -> zpartition.Partitioned | None: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def group(self) -> dist.ProcessGroup | None: ...
    @property
    def _offloaded(self) -> StateOffloader: ...


_BUCKET = OffloadStateTypeEnum.contiguous_grad_buffer
GATHERED = "gathered_params"  # memory_held's name for ZeRO-3 parameters gathered now
TOTAL = "total"  # memory_held's name for every storage once


def state_tensors(engine: StatesEngine, state: OffloadStateTypeEnum) -> dict[str, torch.Tensor]:
    """The tensors the engine holds for `state`, by name (empty tensors left out)."""
    if engine.optimizer is None:  # forward passes only: the parameters are all it holds
        if state is not OffloadStateTypeEnum.lp_params:
            return {}
        return {f"lp.{i}": t for i, t in enumerate(_lp_params(engine)) if t.numel() > 0}
    optimizer = engine.optimizer.resident()  # not on NVMe behind offload_optimizer's back
    parts = optimizer.partitions
    found: dict[str, torch.Tensor] = {}
    if state is OffloadStateTypeEnum.optim_states:
        for i, per_param in enumerate(optimizer.optimizer.state.values()):
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and value.dim():
                    found[f"optim.{i}.{key}"] = value
    elif state is OffloadStateTypeEnum.hp_params:
        if parts.fp32_partitions_flat is not None:
            found["hp"] = parts.fp32_partitions_flat
        else:
            for i, tensor in enumerate(optimizer.stepped_tensors()):
                found[f"hp.{i}"] = tensor  # the parameters are their own fp32 masters
    elif state is OffloadStateTypeEnum.lp_params:
        for i, tensor in enumerate(_lp_params(engine)):
            found[f"lp.{i}"] = tensor
    elif state is OffloadStateTypeEnum.lp_grads:
        found["grads"] = parts.grad_partitions_flat_buffer
        for i, tensor in enumerate(optimizer.layout.grad_flats):
            found[f"grads.full.{i}"] = tensor
        for i, tensor in enumerate(optimizer.layout.low_grad_flats):
            found[f"grads.low.{i}"] = tensor  # one backward's, before they are folded
    elif state is _BUCKET and engine.partitioned is not None:
        # kept between passes on accelerators only (persistent_grad_buckets); on CPU the
        # buckets live while they are reduced, and none is held
        for i, tensor in enumerate(engine.partitioned.grad_buffers):
            found[f"bucket.{i}"] = tensor
    return {k: v for k, v in found.items() if v.numel() > 0}


def _lp_params(engine: StatesEngine) -> list[torch.Tensor]:
    """The compute-dtype parameters: shards (and gathered persistent ones) at stage 3, the
    flat parameter buffers at stages 0-2."""
    if engine.partitioned is None:
        if engine.optimizer is None:
            return [p.data for p in engine.module.parameters()]
        return list(engine.optimizer.layout.flats)
    tensors = []
    for unit in engine.partitioned.units:
        if unit.codes is not None:  # a frozen unit's shard kept as int8 codes (MixZ++)
            tensors += [unit.codes.codes.data, unit.codes.codes.scales]
            continue
        tensors.append(unit.shard)
        if unit.persistent and unit.full is not unit.shard:
            tensors.append(unit.full)
    return tensors


def get_state_devices(engine: StatesEngine, state: OffloadStateTypeEnum | str) -> set[torch.device]:
    """The devices `state`'s tensors are on now: their own, or the host while offloaded to
    host memory; none while on NVMe or freed."""
    devices: set[torch.device] = set()
    for tensor in state_tensors(engine, OffloadStateTypeEnum(state)).values():
        handle = zoffload.handle_of(tensor)
        if handle is None:
            devices.add(tensor.device)
        elif handle.device is OffloadDeviceEnum.cpu:
            devices.add(torch.device("cpu"))
    return devices


def memory_held(engine: StatesEngine) -> dict[str, dict[str, int]]:
    """Bytes the engine holds, by state and by where they are: a device (``cpu``,
    ``cuda:0``) for resident storages, ``cpu`` or ``nvme`` for the copies of offloaded ones.
    The five `OffloadStateTypeEnum` states, `GATHERED` (ZeRO-3 parameters gathered whole now,
    between a forward and its backward or prefetched), and `TOTAL`, where a storage that two
    states share (fp32 parameters are their own masters) counts once. An offloaded storage
    counts zero on its device."""
    held: dict[str, dict[str, int]] = {}
    total: dict[int, tuple[str, int]] = {}

    def count(into: dict[str, int], tensors: Iterable[torch.Tensor]) -> None:
        for key, (where, nbytes) in _resident(tensors).items():
            into[where] = into.get(where, 0) + nbytes
            total[key] = (where, nbytes)

    for state in OffloadStateTypeEnum:
        per_place = held[state.value] = {}
        count(per_place, state_tensors(engine, state).values())
        handle = engine._offloaded.handles.get(state)
        if handle is not None and handle.device is not OffloadDeviceEnum.none:
            place = handle.device.value
            per_place[place] = per_place.get(place, 0) + handle.nbytes
            total[id(handle)] = (place, handle.nbytes)
    held[GATHERED] = {}
    if engine.partitioned is not None:
        gathered = [
            u.full for u in engine.partitioned.units if not u.persistent and u.full is not u.shard
        ]
        count(held[GATHERED], gathered)
    everything: dict[str, int] = {}
    for where, nbytes in total.values():
        everything[where] = everything.get(where, 0) + nbytes
    held[TOTAL] = everything
    return held


def _resident(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[str, int]]:
    """The distinct non-empty storages under `tensors`: identity -> (device, bytes)."""
    found = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found[storage._cdata] = (str(tensor.device), storage.nbytes())
    return found


def _first(tensor: torch.Tensor, seen: set[int]) -> bool:
    """Whether `tensor`'s storage is not among `seen` (and note it)."""
    key = tensor.untyped_storage()._cdata
    if key in seen:
        return False
    seen.add(key)
    return True


def _file_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """About the bytes an offload file of `tensors` takes: their distinct storages and a
    header (aligned, about a hundred bytes a tensor), a little above the real size."""
    data = sum(n for _, n in _resident(tensors.values()).values())
    return data + 4096 * (2 + len(tensors) // 32)


class StateOffloader:
    """The offloaded states of one engine, by type."""

    def __init__(self, offloader: zoffload.Offloader | None = None) -> None:
        self.handles: dict[OffloadStateTypeEnum, zoffload.OffloadHandle] = {}
        # NVMe goes through the config's `aio` settings when it has them
        self.offloader = offloader or zoffload.default_offloader()
        self._reloading: list[zoffload.OffloadHandle] = []  # non-blocking reloads under way

    def offload(
        self,
        engine: StatesEngine,
        include: Iterable[OffloadStateTypeEnum | str] | None,
        device: OffloadDeviceEnum | str,
        *,
        pin_memory: bool,
        non_blocking: bool,
        nvme_path: str | os.PathLike[str] | None,
    ) -> None:
        device = OffloadDeviceEnum(device)
        if device is OffloadDeviceEnum.nvme and nvme_path is None:
            raise ValueError(
                "offload_states(device='nvme'): give nvme_path=, or set "
                "zero_optimization.offload_optimizer.nvme_path in the config"
            )
        chosen = [OffloadStateTypeEnum(s) for s in (include or list(OffloadStateTypeEnum))]
        self.settle()  # a reload still under way finishes first
        if engine.partitioned is not None:
            engine.partitioned.coordinator.release_all()  # nothing gathered stays behind
        moves: dict[OffloadStateTypeEnum, tuple[OffloadDeviceEnum, dict[str, torch.Tensor]]] = {}
        claimed: set[int] = set()  # storages two states share move once
        for state in chosen:
            if state in self.handles:
                continue  # already offloaded
            # the gradient bucket is scratch space: freed, not copied (as DeepSpeed does)
            target = OffloadDeviceEnum.none if state is _BUCKET else device
            tensors = {
                name: t
                for name, t in state_tensors(engine, state).items()
                if zoffload.handle_of(t) is None  # shared with a state offloaded already
                # to the host what lives there already: nothing to move (DeepSpeed's .to())
                and not (target is OffloadDeviceEnum.cpu and t.device.type == "cpu")
                and _first(t, claimed)
            }
            if tensors:
                moves[state] = (target, tensors)
        if device is OffloadDeviceEnum.nvme:
            assert nvme_path is not None
            self._to_nvme(engine, moves, nvme_path, pin_memory=pin_memory)
        for state, (target, tensors) in moves.items():
            if state not in self.handles:
                self.handles[state] = self.offloader.offload(
                    tensors,
                    target,
                    pin_memory=pin_memory,
                    non_blocking=non_blocking,
                    nvme_path=nvme_path,
                )
        if not non_blocking:
            self._give_back()  # the staging buffers of NVMe writes are not kept

    def _to_nvme(
        self,
        engine: StatesEngine,
        moves: dict[OffloadStateTypeEnum, tuple[OffloadDeviceEnum, dict[str, torch.Tensor]]],
        nvme_path: str | os.PathLike[str],
        *,
        pin_memory: bool,
    ) -> None:
        """The states bound for NVMe, moved on every rank or on none ([Note: NVMe faults
        agreed]): the folder and its space checked and agreed first, the files written with
        the bytes kept, the writes agreed, and only then the tensors emptied. Waits for the
        writes (``non_blocking`` or not): the ranks agree on them before any memory goes."""
        what = "offload_states(device='nvme')"
        files = {s: m for s, m in moves.items() if m[0] is OffloadDeviceEnum.nvme}
        needed = sum(_file_nbytes(tensors) for _, tensors in files.values())
        agree_on_folders([(nvme_path, needed)], engine.group, what)
        written: dict[OffloadStateTypeEnum, zoffload.OffloadHandle] = {}
        error: BaseException | None = None
        try:
            for state, (_, tensors) in files.items():
                written[state] = self.offloader.offload(
                    tensors, "nvme", pin_memory=pin_memory, nvme_path=nvme_path, commit=False
                )
        except zoffload.OffloadError as failed:  # an OSError comes named (NvmeError)
            error = failed
        try:
            agree_on_outcome(error, engine.group, what)
        except zoffload.NvmeError:
            for handle in written.values():
                handle.abandon()  # the files go; the bytes never left
            self._give_back()
            raise
        for state, handle in written.items():
            self.handles[state] = handle.commit()

    def reload(self, *, non_blocking: bool) -> None:
        handles, self.handles = self.handles, {}
        for handle in handles.values():
            handle.reload(non_blocking=non_blocking)
        self._reloading.extend(handles.values())
        if not non_blocking:
            self.settle()

    def settle(self) -> None:
        """Wait for a non-blocking reload, and give the host memory it used back: after a
        reload the process holds what it held before the offload, no staging buffers or
        pooled copies ([Note: offload_states' footprint])."""
        if not self._reloading:
            return
        reloading, self._reloading = self._reloading, []
        for handle in reloading:
            handle.wait()
        self._give_back()

    def _give_back(self) -> None:
        self.offloader.pool.trim()

    def require(
        self, engine: StatesEngine, call: str, states: Iterable[OffloadStateTypeEnum]
    ) -> None:
        """Refuse `call` while any of `states` is offloaded (its tensors are empty: reading
        them would crash the process on CPU and read freed memory on a GPU); wait for a
        non-blocking reload first."""
        self.settle()
        if not self.handles:
            return
        away = sorted(
            state.value
            for state in states
            if any(zoffload.handle_of(t) is not None for t in state_tensors(engine, state).values())
        )
        if away:
            raise UsageError(
                f"engine.{call}: the training states {', '.join(away)} are offloaded "
                "(engine.offload_states()); call engine.reload_states() first"
            )
