"""Gradients reduced in buckets while backward runs (stages 0-2; stage 3's are zpartition's).

[Note: gradient buckets]
Each group's flat parameter range is cut, at parameter boundaries, into buckets of at most
``reduce_bucket_size`` elements (a larger parameter is a bucket of its own). When autograd has
accumulated a parameter's gradient, a hook marks it arrived in its bucket. At stage 2 the hook
copies the gradient into the bucket (allocated at the bucket's first gradient, zeros elsewhere)
and drops it, so a rank keeps no full gradients, only its partition of them; at stages 0 and 1
the gradients accumulate over the micro-batches in a flat buffer the parameters' ``.grad`` are
views of, a bucket is a range of that buffer, and the hooks act in the backward that ends the
accumulation only.

The buckets are reduced in one fixed order on every rank, the last first (the order backward
usually finishes them): a bucket goes once it and every bucket before it in that order are
complete, and what is left goes at the end of backward (a parameter this rank did not use
leaves zeros), so the ranks' collectives pair up whatever each rank's graph used. A bucket is
all-reduced (average) and each rank adds the part that lies in its partition to its gradient
partition: twice the bytes of a reduce-scatter (what DDP moves), since contiguous parameters
mostly lie in one rank's partition, which one reduce-scatter cannot aim at; a bucket that is a
whole group (``reduce_bucket_size`` at least the group's size, as DeepSpeed's default 5e8 mostly
is) is reduce-scattered instead, straight into the partitions. With ``overlap_comm`` the
reductions run while backward goes on; without, each is waited for when it is started. A
bucket is landed (waited for, its part added to the partition, let go) once the bucket after it
is started, so at most two are alive at a time, as in DeepSpeed's double buffer. Stage 3's
buckets are zpartition's (`zpartition/_reduce.py`); why they are not these: ARCHITECTURE.md,
"Two gradient buckets, on purpose".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

import zcomm
from zengine._optim._autocast import get_comm_dtype, has_comm_dtype

__all__ = ["GradBuckets"]


@dataclasses.dataclass(eq=False)
class _Bucket:
    group: int
    lo: int  # the bucket's range of the group's flat buffer
    hi: int
    params: list[tuple[nn.Parameter, int]]  # its parameters, with their offsets in the flat
    dtype: torch.dtype  # what it is reduced in
    device: torch.device
    waiting: int = 0  # gradients still to come in this backward
    view: torch.Tensor | None = None  # stages 0, 1: the bucket's range of the gradient buffer
    low: torch.Tensor | None = None  # its range of the compute-dtype buffer, when that differs
    folded: bool = False  # this backward's gradients are in `view` (only with `low`)
    buffer: torch.Tensor | None = None
    handle: zcomm.Handle | None = None
    scattered: torch.Tensor | None = None  # a whole group's bucket: this rank's partition

    def fresh(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = (
                self.view
                if self.view is not None
                else torch.zeros(self.hi - self.lo, dtype=self.dtype, device=self.device)
            )
        return self.buffer


class GradBuckets:
    """Reduces the gradients of `params` (per group, with their offsets in the group's flat
    buffer) into `grads` (per group, this rank's partition ``[lo, lo + size)`` of it; the
    whole buffer at stage 0). `storage`: the flat gradient buffers the ``.grad`` are views of
    (stages 0, 1); None: each gradient is copied into its bucket and dropped (stage 2).
    `low`: with `storage` of a wider dtype, the compute-dtype buffers the ``.grad`` are views
    of, folded into `storage` after every backward. `dtype`: what the reductions run in
    (``communication_data_type``), unless the parameters' ``comm_dtype`` says otherwise (see
    `_cut`); None: the parameters'. `scale`: the factors of DeepSpeed's reduction options
    (`GradReduction.factors`), None for the mean."""

    def __init__(
        self,
        params: Sequence[Sequence[tuple[nn.Parameter, int]]],
        flats: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        partitions: Sequence[tuple[int, int]],
        *,
        group: dist.ProcessGroup | None,
        bucket_size: int,
        overlap: bool,
        storage: Sequence[torch.Tensor] | None = None,
        low: Sequence[torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
        scale: tuple[float, float] | None = None,
    ) -> None:
        self.group = group
        # (before, after) the sum of a bucket, in its dtype ([Note: gradient reduction]);
        # None: the mean
        self.scale = scale
        self.storage = None if storage is None else list(storage)
        self.folding = low is not None  # every backward's hooks fold their buckets
        self.armed = True  # whether this backward's hooks act (stages 0, 1: the boundary's)
        # stage 2: gradients held by backward passes that reduced nothing, by id(param), in the
        # accumulation dtype ([Note: holding gradients]); taken with the next arrival
        self.held: dict[int, torch.Tensor] = {}
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.overlap = overlap
        self.grads = list(grads)
        self.partitions = list(partitions)
        self._order: list[_Bucket] = []  # reduction order: each group's last bucket first
        self._bucket_of: dict[int, tuple[_Bucket, int]] = {}  # id(param) -> its bucket, offset
        for g, (pairs, flat) in enumerate(zip(params, flats, strict=True)):
            buckets = _cut(g, pairs, flat, max(bucket_size, 1), dtype or flat.dtype)
            for bucket in buckets:
                for p, offset in bucket.params:
                    self._bucket_of[id(p)] = (bucket, offset - bucket.lo)
                if self.storage is not None:
                    bucket.view = self.storage[g][bucket.lo : bucket.hi]
                if low is not None:
                    bucket.low = low[g][bucket.lo : bucket.hi]
            self._order += reversed(buckets)
        self._next = 0  # the first bucket of `_order` not started in this backward
        self._landed = 0  # the buckets before this one are reduced into the partitions
        self._handles = [
            p.register_post_accumulate_grad_hook(self._arrived)  # type: ignore[no-untyped-call]
            for pairs in params
            for p, _ in pairs
            if p.requires_grad
        ]
        self._reset()

    def remove(self) -> None:
        """Take the hooks off the parameters (the engine is done with them)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _reset(self) -> None:
        for bucket in self._order:
            bucket.waiting = sum(p.requires_grad for p, _ in bucket.params)
            bucket.buffer, bucket.handle, bucket.scattered = None, None, None
            bucket.folded = False
        self._next, self._landed = 0, 0

    def _arrived(self, param: torch.Tensor) -> None:
        if not (self.armed or self.folding):
            return
        bucket, offset = self._bucket_of[id(param)]
        grad = param.grad
        earlier = self.held.pop(id(param), None) if self.held else None
        if earlier is not None:
            grad = earlier if grad is None else earlier.add_(grad)
        if grad is not None and self.storage is None:
            bucket.fresh()[offset : offset + grad.numel()].add_(grad.reshape(-1))
            param.grad = None  # the bucket holds it now
        bucket.waiting -= 1
        if not self.armed:
            if bucket.waiting <= 0:
                self._fold(bucket)
            return
        while self._next < len(self._order) and self._order[self._next].waiting <= 0:
            self._start(self._order[self._next])

    def hold(self, params: Iterable[nn.Parameter], dtype: torch.dtype) -> None:
        """Stage 2, after a backward whose hooks stood aside: move the gradients it left in
        ``.grad`` into `held`, summed in `dtype` ([Note: holding gradients])."""
        for p in params:
            grad = p.grad
            if grad is None:
                continue
            p.grad = None
            mine = self.held.get(id(p))
            if mine is None:
                self.held[id(p)] = grad.to(dtype)  # autograd's, let go: no copy in its dtype
            else:
                mine.add_(grad)

    def take_left(self, params: Iterable[nn.Parameter]) -> None:
        """Stage 2: take the held gradients no hook of this backward took into their buckets,
        as if they arrived now."""
        for p in params:
            if id(p) in self.held:
                self._arrived(p)

    @staticmethod
    def _fold(bucket: _Bucket) -> None:
        """This backward's gradients of `bucket`, added into the wide buffer (`low` only)."""
        if bucket.low is not None and bucket.view is not None and not bucket.folded:
            bucket.view.add_(bucket.low)
            bucket.low.zero_()
            bucket.folded = True

    def fold(self) -> None:
        """The end of a backward that reduces nothing: fold what the hooks did not (buckets
        with a parameter this backward did not use), and get ready for the next backward."""
        for bucket in self._order:
            self._fold(bucket)
        self._reset()

    def _start(self, bucket: _Bucket) -> None:
        self._fold(bucket)
        buffer, (_, size) = bucket.fresh(), self.partitions[bucket.group]
        if buffer.dtype != bucket.dtype:  # a range of the gradient buffer, reduced in another
            buffer = bucket.buffer = buffer.to(bucket.dtype)
        op = zcomm.ReduceOp.AVG
        if self.scale is not None:
            op = zcomm.ReduceOp.SUM
            if self.scale[0] != 1.0:  # the buffer is dropped, or zeroed, once reduced
                buffer.mul_(self.scale[0])
        if bucket.lo == 0 and bucket.hi == buffer.numel() == size * self.world:
            # reduced in place: this rank's chunk of the buffer is its partition's part
            bucket.scattered = buffer[self.rank * size :][:size]
            bucket.handle = zcomm.reduce_scatter_tensor(
                bucket.scattered,
                buffer,
                op=op,
                group=self.group,
                async_op=self.overlap,
                scratch_input=True,  # the buffer is dropped, or zeroed (stages 0, 1), after
            )
        else:
            bucket.handle = zcomm.all_reduce(buffer, op=op, group=self.group, async_op=self.overlap)
        self._next += 1
        # the buckets started before this one had a bucket's worth of backward to finish in:
        # landing them now keeps at most two buckets alive (stage 2 held every bucket until
        # the end of backward, the full gradients over again)
        self._land(self._next - 1)

    def _land(self, upto: int) -> None:
        """Wait for the reductions of the buckets started before `upto` (in order), add their
        parts in this rank's partition to the gradient partitions, and let go of them."""
        for bucket in self._order[self._landed : upto]:
            assert bucket.handle is not None
            assert bucket.buffer is not None
            bucket.handle.wait()
            lo, size = self.partitions[bucket.group]
            start, stop = max(bucket.lo, lo), min(bucket.hi, lo + size)
            mine = bucket.scattered
            if mine is None and start < stop:
                mine = bucket.buffer[start - bucket.lo : stop - bucket.lo]
            if mine is not None:
                if self.scale is not None and self.scale[1] != 1.0:
                    mine.mul_(self.scale[1])  # in the reduction's dtype, as DeepSpeed
                part = self.grads[bucket.group][start - lo : stop - lo]
                part.add_(mine if mine.device == part.device else mine.to(part.device))
            bucket.buffer, bucket.handle, bucket.scattered = None, None, None
        self._landed = max(self._landed, upto)

    def finish(self) -> None:
        """The end of a backward: reduce what is left, land every bucket, and get ready for the
        next backward."""
        while self._next < len(self._order):
            self._start(self._order[self._next])
        self._land(len(self._order))
        for buffer in self.storage or []:
            buffer.zero_()  # the next accumulation starts from nothing
        self._reset()


def _cut(
    g: int,
    pairs: Sequence[tuple[nn.Parameter, int]],
    flat: torch.Tensor,
    size: int,
    dtype: torch.dtype,
) -> list[_Bucket]:
    """Group `g`'s buckets, in flat order; the last one reaches the flat's end (padding).

    A bucket is reduced in its parameters' ``comm_dtype`` when they share one (autocast's
    lower-precision-safe modules), else in `dtype`. A group cut into several buckets is also
    cut where the ``comm_dtype`` changes, so its all-reduces carry each run in its own dtype;
    a group that is one bucket stays one, reduced in `dtype`: at stages 1 and 2 its
    reduce-scatter moves no more bytes than all-reduces of the narrower runs would; at stage 0
    (an all-reduce) the runs would move fewer bytes, in a collective per run (a transformer
    alternates Linear and LayerNorm), which is left to ``reduce_bucket_size`` to choose."""
    comms = [get_comm_dtype(p) if has_comm_dtype(p) else dtype for p, _ in pairs]
    split = flat.numel() > size and len(set(comms)) > 1
    buckets: list[_Bucket] = []
    current: list[tuple[nn.Parameter, int]] = []
    kinds: set[torch.dtype] = set()
    lo = 0

    def close(hi: int) -> None:
        common = next(iter(kinds)) if len(kinds) == 1 else dtype
        buckets.append(_Bucket(g, lo, hi, current, common, flat.device))

    for (p, offset), comm in zip(pairs, comms, strict=True):
        end = offset + p.numel()
        if current and (end - lo > size or (split and comm not in kinds)):
            close(offset)
            current, kinds, lo = [], set(), offset
        current.append((p, offset))
        kinds.add(comm)
    close(flat.numel())
    return buckets
