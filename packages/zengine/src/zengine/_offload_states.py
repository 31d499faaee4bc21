"""``engine.offload_states`` / ``reload_states`` and `get_state_devices`, on zoffload.

Each of DeepSpeed's five state types names the tensors the engine holds for it. Offloading moves
their storages (zoffload empties the same storage objects the optimizer and the model point at,
so no reference goes stale) to host memory or to NVMe files; reloading fills them again,
bit-exact. Two types can share storage (fp32 parameters are their own masters: ``hp_params``
and ``lp_params`` are then the same bytes), which moves once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

import zoffload
from zoffload import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["StateOffloader", "get_state_devices"]


def state_tensors(engine: Any, state: OffloadStateTypeEnum) -> dict[str, torch.Tensor]:
    """The tensors the engine holds for `state`, by name (empty tensors left out)."""
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
        for i, tensor in enumerate(getattr(optimizer.layout, "grad_flats", [])):
            found[f"grads.full.{i}"] = tensor
        for i, tensor in enumerate(getattr(optimizer.layout, "low_grad_flats", [])):
            found[f"grads.low.{i}"] = tensor  # one backward's, before they are folded
    elif state is OffloadStateTypeEnum.contiguous_grad_buffer and engine.partitioned is not None:
        # kept between passes on accelerators only (persistent_grad_buckets); on CPU the
        # buckets live while they are reduced, and none is held
        for i, tensor in enumerate(engine.partitioned.grad_buffers):
            found[f"bucket.{i}"] = tensor
    return {k: v for k, v in found.items() if v.numel() > 0}


def _lp_params(engine: Any) -> list[torch.Tensor]:
    """The compute-dtype parameters: shards (and gathered persistent ones) at stage 3, the
    flat parameter buffers at stages 0-2."""
    if engine.partitioned is None:
        return list(engine.optimizer.layout.flats)
    tensors = []
    for unit in engine.partitioned.units:
        tensors.append(unit.shard)
        if unit.persistent and unit.full is not unit.shard:
            tensors.append(unit.full)
    return tensors


def get_state_devices(engine: Any, state: OffloadStateTypeEnum | str) -> set[torch.device]:
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


class StateOffloader:
    """The offloaded states of one engine, by type."""

    def __init__(self, offloader: zoffload.Offloader | None = None) -> None:
        self.handles: dict[OffloadStateTypeEnum, zoffload.OffloadHandle] = {}
        # NVMe goes through the config's `aio` settings when it has them
        self.offloader = offloader or zoffload.default_offloader()

    def offload(
        self,
        engine: Any,
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
        if engine.partitioned is not None:
            engine.partitioned.coordinator.release_all()  # nothing gathered stays behind
        for state in chosen:
            if state in self.handles:
                continue  # already offloaded
            tensors = {
                name: t
                for name, t in state_tensors(engine, state).items()
                if zoffload.handle_of(t) is None  # shared with a state offloaded already
            }
            if not tensors:
                continue
            self.handles[state] = self.offloader.offload(
                tensors,
                # the gradient bucket is scratch space: freed, not copied (as DeepSpeed does)
                OffloadDeviceEnum.none
                if state is OffloadStateTypeEnum.contiguous_grad_buffer
                else device,
                pin_memory=pin_memory,
                non_blocking=non_blocking,
                nvme_path=nvme_path,
            )

        if device is OffloadDeviceEnum.nvme and not non_blocking:
            zoffload.default_pool().trim()  # the staging buffers of the writes: not kept

    def reload(self, *, non_blocking: bool) -> None:
        handles, self.handles = self.handles, {}
        for handle in handles.values():
            handle.reload(non_blocking=non_blocking)
