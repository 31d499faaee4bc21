"""One unit of communication: parameters gathered, released and reduced together.

[Note: unit layout]
A parameter of n elements is cut into W chunks of c = ceil(n / W) elements (the last rank's
padded) and this rank keeps chunk r as ``ds_tensor``. A unit keeps its parameters' chunks back
to back in one byte buffer, the *shard*, so its all-gather is one collective of bytes whatever
the dtypes. The gathered bytes are rank-major (rank 0's shard, rank 1's shard, ...); parameter
i's full data is the column block i of them viewed as (W, shard bytes), copied once into the
*full* buffer, where each parameter lies contiguous.

The full buffer is freed by resizing its storage to 0 bytes, not by dropping it: autograd keeps
views of it (``addmm`` saves ``weight.t()``), and resizing frees the memory under those views,
while the gather before backward fills the same storage again (FSDP2 frees the same way). With
one rank and the shard on the compute device, the shard *is* the full data: nothing is copied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

import zcomm
from zpartition._channel import Channel, Kind
from zpartition._status import ZeroParamStatus

__all__ = ["Unit"]

_ALIGN = 16  # bytes; every parameter's chunk starts aligned for any dtype's view
_AVAILABLE, _NOT_AVAILABLE, _INFLIGHT = (
    ZeroParamStatus.AVAILABLE,
    ZeroParamStatus.NOT_AVAILABLE,
    ZeroParamStatus.INFLIGHT,
)


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


class _GradGroup:
    """The unit's trainable parameters of one dtype, reduce-scattered together."""

    __slots__ = ("columns", "dtype", "indices", "shard_grad", "width")

    def __init__(self, dtype: torch.dtype, indices: list[int], chunks: list[int]) -> None:
        self.dtype = dtype
        self.indices = indices
        self.columns: list[tuple[int, int]] = []  # (offset, chunk) in the rank-major rows
        self.width = 0
        for i in indices:
            self.columns.append((self.width, chunks[i]))
            self.width += chunks[i]
        self.shard_grad: torch.Tensor | None = None  # this rank's gradients, one flat tensor


class Unit:
    """The parameters of one module (or a leaf module's subtree) and their storage."""

    def __init__(
        self,
        uid: int,
        name: str,
        params: Sequence[nn.Parameter],
        channel: Channel,
        *,
        device: torch.device,
    ) -> None:
        self.uid = uid  # the same on every rank: named in the channel's headers
        self.name = name  # the module's qualified name, for messages
        self.params = list(params)
        self.channel = channel
        self.device = device  # where computation reads the full parameters
        self.status = _NOT_AVAILABLE
        self.users: set[int] = set()  # ids of modules (and contexts) that need it gathered now
        self.persistent = False  # kept gathered all the time (never released)
        self.handle: zcomm.Handle | None = None  # the all-gather in flight
        self.numel = sum(int(p.ds_numel) for p in self.params)
        self.ready = 0  # trainable parameters whose gradient arrived in this backward
        self._gathered_version = -1  # the shards' version at the last refresh
        world = channel.size
        self.chunks = [math.ceil(int(p.ds_numel) / world) for p in self.params]
        self._build_shard()
        self._direct = world == 1 and self.shard.device == device
        self._build_full()
        self.empties = [torch.empty(0, dtype=p.dtype, device=device) for p in self.params]
        trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.trainable = len(trainable)
        dtypes = sorted({self.params[i].dtype for i in trainable}, key=str)
        self.grad_groups = [
            _GradGroup(d, [i for i in trainable if self.params[i].dtype == d], self.chunks)
            for d in dtypes
        ]
        for p in self.params:
            p.ds_unit = self
            p.ds_status = _NOT_AVAILABLE
            p.ds_active_sub_modules = self.users

    # -- storage ---------------------------------------------------------------------------

    def _build_shard(self) -> None:
        """Copy each parameter's chunk into one byte buffer; ``ds_tensor`` becomes a view."""
        offsets, end = [], 0
        for p, c in zip(self.params, self.chunks, strict=True):
            offsets.append(end)
            end = _aligned(end + c * p.element_size())
        first = self.params[0].ds_tensor if self.params else torch.empty(0)
        self.shard = torch.zeros(end, dtype=torch.uint8, device=first.device)
        self.offsets = offsets
        for p, c, off in zip(self.params, self.chunks, offsets, strict=True):
            view = self.shard[off : off + c * p.element_size()].view(p.dtype)
            view.copy_(p.ds_tensor)
            p.ds_tensor = view

    def _build_full(self) -> None:
        """The full buffer and each parameter's full view of it (the shard itself when direct)."""
        world = self.channel.size
        if self._direct:
            self.full = self.shard
            self.views = [
                p.ds_tensor.view(p.ds_shape) for p in self.params
            ]  # c == n with one rank
            self._copy_plan: list[tuple[torch.Tensor, int, int]] = []
            return
        starts, end = [], 0
        for p, c in zip(self.params, self.chunks, strict=True):
            starts.append(end)
            end = _aligned(end + world * c * p.element_size())
        self.full = torch.empty(end, dtype=torch.uint8, device=self.device)
        self.views, self._copy_plan = [], []
        for p, c, start, off in zip(self.params, self.chunks, starts, self.offsets, strict=True):
            nbytes = c * p.element_size()
            block = self.full[start : start + world * nbytes]
            self.views.append(block.view(p.dtype)[: int(p.ds_numel)].view(p.ds_shape))
            self._copy_plan.append((block.view(world, nbytes), off, nbytes))
        self._full_bytes = end
        self.full.untyped_storage().resize_(0)

    # -- gather and release ----------------------------------------------------------------

    def issue_gather(self) -> None:
        """Start this unit's all-gather (the caller agreed on it with the other ranks)."""
        if self._direct:
            self.channel.count_live(self.numel if not self.persistent else 0)
            self._show()
            return
        self.status = _INFLIGHT
        for p in self.params:
            p.ds_status = _INFLIGHT
        channel = self.channel
        channel.count_live(self.numel if not self.persistent else 0)
        source = self.shard if self.shard.device == self.device else self.shard.to(self.device)
        self._gathered = source.new_empty(channel.size * source.numel())
        self.handle = zcomm.all_gather_into_tensor(
            self._gathered, source, group=channel.group, async_op=channel.size > 1
        )

    def wait(self) -> None:
        """Finish the gather: the full parameters are in ``param.data`` afterwards."""
        if self.status is not _INFLIGHT:
            return
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.wait()
        self.full.untyped_storage().resize_(self._full_bytes)
        rows = self._gathered.view(self.channel.size, -1)
        torch._foreach_copy_(
            [dst for dst, _, _ in self._copy_plan],
            [rows[:, off : off + nbytes] for _, off, nbytes in self._copy_plan],
        )
        del self._gathered
        self._show()

    def _show(self) -> None:
        for p, view in zip(self.params, self.views, strict=True):
            p.data = view
            p.ds_status = _AVAILABLE
        self.status = _AVAILABLE

    def release(self) -> None:
        """Empty ``param.data`` and free the full buffer (the shards stay)."""
        if self.status is _NOT_AVAILABLE:
            return
        if self.status is _INFLIGHT:
            self.wait()
        self.channel.count_live(-self.numel if not self.persistent else 0)
        for p, empty in zip(self.params, self.empties, strict=True):
            p.data = empty
            p.ds_status = _NOT_AVAILABLE
        if not self._direct:
            self.full.untyped_storage().resize_(0)
        self.status = _NOT_AVAILABLE

    def refresh(self) -> None:
        """Gather again if the shards changed since the last gather (an optimizer stepped);
        for persistent units, which are never released. The shards' version counter says it:
        every rank runs the same optimizer, so every rank decides alike."""
        version = self.shard._version
        if self._direct or version == self._gathered_version:
            if self.status is _NOT_AVAILABLE:
                self._show()
            return
        self.channel.agree(Kind.GATHER, [self.uid])
        self.status = _NOT_AVAILABLE
        self.issue_gather()
        self.wait()
        self._gathered_version = version

    # -- gradients -------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Average each trainable parameter's full gradient across ranks into this rank's
        ``ds_tensor.grad`` (accumulating) and drop the full gradient."""
        self.ready = 0
        if not self.grad_groups:
            return
        if self._direct:
            self._keep_local_gradients()
            return
        self.channel.agree(Kind.REDUCE, [self.uid])
        for group in self.grad_groups:
            self._reduce_group(group)

    def _keep_local_gradients(self) -> None:
        for group in self.grad_groups:
            for i in group.indices:
                p = self.params[i]
                grad = p.grad
                if grad is None:
                    continue
                p.grad = None
                shard = p.ds_tensor
                if shard.grad is None:
                    shard.grad = grad.view(-1)
                else:
                    shard.grad.add_(grad.view(-1))

    def _reduce_group(self, group: _GradGroup) -> None:
        world = self.channel.size
        rows = torch.zeros(world, group.width, dtype=group.dtype, device=self.device)
        for i, (off, chunk) in zip(group.indices, group.columns, strict=True):
            p = self.params[i]
            grad = p.grad
            if grad is None:
                continue  # an unused parameter contributes zeros, on every rank alike
            p.grad = None
            flat, whole = grad.reshape(-1), divmod(int(p.ds_numel), chunk)
            block = rows[:, off : off + chunk]
            block[: whole[0]].copy_(flat[: whole[0] * chunk].view(whole[0], chunk))
            if whole[1]:
                block[whole[0], : whole[1]].copy_(flat[whole[0] * chunk :])
        mine = rows.new_empty(group.width)
        zcomm.reduce_scatter_tensor(
            mine, rows.view(-1), op=zcomm.ReduceOp.AVG, group=self.channel.group
        )
        self._accumulate(group, mine)

    def _accumulate(self, group: _GradGroup, mine: torch.Tensor) -> None:
        shards = [self.params[i].ds_tensor for i in group.indices]
        flat = group.shard_grad
        views_live = flat is not None and all(
            s.grad is not None and s.grad.data_ptr() == flat[off:].data_ptr()
            for s, (off, _) in zip(shards, group.columns, strict=True)
        )
        if views_live:
            assert flat is not None
            flat.add_(mine.to(flat.device))
            return
        flat = mine.to(shards[0].device) if shards else mine
        group.shard_grad = flat
        for s, (off, chunk) in zip(shards, group.columns, strict=True):
            s.grad = flat[off : off + chunk]
