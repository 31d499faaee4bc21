"""How parameters and gradients reach the flat partitions, per ZeRO stage.

`FlatLayout` (stages 0, 1, 2): each group's parameters are packed into one flat buffer of the
compute dtype and become views of it. The gradients are reduced in buckets while backward runs
([Note: gradient buckets] in _grad_buckets.py): at stages 0 and 1 the ``.grad`` are views of a
flat gradient buffer, where autograd accumulates over the micro-batches, reduced during the
backward that ends the accumulation (all-reduced at stage 0); stage 2 keeps no full gradients:
each backward's are copied into buckets, reduced and dropped, each rank keeping its partition.
After the step the updated partitions are all-gathered back into the parameters. Stages 0 and 1
may accumulate in a wider dtype than the parameters' (`accumulate_dtype`): the ``.grad`` then
hold one backward's gradients, folded into the wide buffer after each backward (bucket by
bucket by the hooks; a pipeline folds whole buffers after each micro-batch, `fold`).

`ShardedLayout` (stage 3): zpartition owns the parameters; its gradient sink adds each reduced
shard gradient into the partition's gradient buffer, and after the step the masters are copied
into the shards (``ds_tensor``).

With ``offload_optimizer`` the partitions (masters and gradients) live on `master_device`, the
host: reduced gradients are copied there as they arrive, and the updated masters are copied back
after the step. `own_masters` keeps the masters a copy of their own even where the parameters
could serve (fp32 on the same device): NVMe offload empties the masters between steps, and the
parameters must stay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

import zcomm
import zpartition
from zengine._offload import GradientSwap, NvmeShardStore
from zengine._optim._grad_buckets import GradBuckets
from zengine._optim._partitions import Partitions
from zpartition import ZeroParameter

__all__ = ["FlatLayout", "ShardedLayout"]


_SinkTarget = tuple[
    Sequence[nn.Parameter], "list[int] | None", list[torch.Tensor], "torch.device | None"
]
"""What a gradient group's parameters add into: see `ShardedLayout._sink_target`."""

ALIGNMENT = 2
"""Elements each rank's partition of a group starts on (stages 1 and 2): 4 bytes of a 16-bit
dtype, so that NCCL's all-gather reads aligned buffers, as DeepSpeed aligns them (its
``nccl_start_alignment_factor``)."""


def _padded(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


def _add_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src``, copying `src` to `dst`'s device first (the host, when offloading)."""
    dst.add_(src if src.device == dst.device else src.to(dst.device))


class FlatLayout:
    """Stages 0-2: parameters as views of one flat buffer per group."""

    def __init__(
        self,
        groups: Sequence[Sequence[nn.Parameter]],
        *,
        stage: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        master_device: torch.device | None = None,
        own_masters: bool = False,
        bucket_size: int = 500_000_000,
        overlap: bool = False,
        during_backward: bool = True,
        reduce_dtype: torch.dtype | None = None,
        accumulate_dtype: torch.dtype | None = None,
        reduce_scale: tuple[float, float] | None = None,
    ) -> None:
        """`bucket_size`, `overlap`, `reduce_dtype` and `accumulate_dtype`:
        ``reduce_bucket_size``, ``overlap_comm``, ``communication_data_type`` and
        ``data_types.grad_accum_dtype`` (stages 0 and 1; stage 2 adds each backward's reduced
        gradients into fp32 partitions, stage 3 is `ShardedLayout`'s); `reduce_scale`: the
        factors of DeepSpeed's reduction options (`GradReduction.factors`; None: the mean). Without
        `during_backward` (a pipeline, whose batch runs many backward passes and reduces tied
        weights' gradients after them) stages 0 and 1 reduce when ``after_backward`` says."""
        self.stage = stage
        self.during_backward = during_backward
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = [list(g) for g in groups]
        self.flats: list[torch.Tensor] = []  # per group, the parameters' storage
        self.grad_flats: list[torch.Tensor] = []  # per group, the full gradients (stages 0, 1)
        self.grad_views: list[list[torch.Tensor]] = []
        # per group, the compute-dtype gradients the .grad are views of, when grad_flats are
        # of a wider dtype (stages 0, 1): one backward's, folded into grad_flats after it
        self.low_grad_flats: list[torch.Tensor] = []
        self.masters_unread = False  # the flat buffers are the masters (no tile-wise first read)
        pieces, sizes, offsets, ranges = [], [], [], []
        for params in self.params:
            flat, layout = self._pack(params, device)
            self.flats.append(flat)
            if stage < 2:
                grads, views = self._grad_views(flat, params, layout)
                if accumulate_dtype not in (None, flat.dtype):
                    self.low_grad_flats.append(grads)
                    grads = torch.zeros_like(grads, dtype=accumulate_dtype)
                self.grad_flats.append(grads)
                self.grad_views.append(views)
            size = flat.numel() if stage == 0 else flat.numel() // self.world
            lo = 0 if stage == 0 else self.rank * size
            pieces.append(self._pieces(params, layout, lo, lo + size))
            sizes.append(size)
            offsets.append(list(zip(params, layout, strict=True)))
            ranges.append((lo, size))
        # fp32 parameters are their own masters: the optimizer steps this rank's slice in place
        master_device = master_device or device
        self.aliased = (
            not own_masters
            and master_device == device
            and all(f.dtype == torch.float32 for f in self.flats)
        )
        self._sizes = sizes
        mine = [self._mine(flat, g) for g, flat in enumerate(self.flats)]
        self.partitions = Partitions(
            pieces, master_device, sizes, masters=mine if self.aliased else None
        )
        self.read_back()
        self.buckets = GradBuckets(
            offsets,
            self.flats,
            self.partitions.grads,
            ranges,
            group=group,
            bucket_size=bucket_size,
            overlap=overlap,
            storage=self.grad_flats if stage < 2 else None,
            # a pipeline folds whole buffers itself (`fold`): its split backward writes .grad
            # past the hooks
            low=(self.low_grad_flats or None) if during_backward else None,
            dtype=reduce_dtype,
            scale=reduce_scale,
        )
        # id(param) -> (group, offset in the group's flat buffers)
        self._offset_of = {id(p): (g, off) for g, pairs in enumerate(offsets) for p, off in pairs}
        self._accumulated = False  # the gradient buffers hold sums no reduction has taken yet
        # stage 2 inside coalesce_grad_reduction: backward passes hold the full
        # gradients, in this dtype, and whether some are held ([Note: holding gradients])
        self._holding = False
        self._held = False
        compute = self.flats[0].dtype if self.flats else torch.float32
        self._held_dtype = accumulate_dtype or compute

    def _pack(
        self, params: list[nn.Parameter], device: torch.device
    ) -> tuple[torch.Tensor, list[int]]:
        """One flat buffer holding `params`, which become views of it; their offsets."""
        total = sum(p.numel() for p in params)
        dtype = params[0].dtype if params else torch.float32
        multiple = self.world * (ALIGNMENT if self.stage > 0 else 1)  # partitions aligned
        flat = torch.zeros(_padded(total, multiple), dtype=dtype, device=device)
        offsets, offset = [], 0
        for p in params:
            n = p.numel()
            flat[offset : offset + n].copy_(p.data.reshape(-1))
            p.data = flat[offset : offset + n].view_as(p)
            offsets.append(offset)
            offset += n
        return flat, offsets

    @staticmethod
    def _grad_views(
        flat: torch.Tensor, params: list[nn.Parameter], offsets: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A flat gradient buffer like `flat`, and each parameter's view of it."""
        grads = torch.zeros_like(flat)
        views = [
            grads[off : off + p.numel()].view_as(p) for p, off in zip(params, offsets, strict=True)
        ]
        return grads, views

    @staticmethod
    def _pieces(
        params: list[nn.Parameter], offsets: list[int], lo: int, hi: int
    ) -> list[tuple[nn.Parameter, int, int]]:
        """The part of each parameter inside [lo, hi) of the flat buffer; an empty piece for a
        parameter wholly on other ranks, so every rank knows every parameter (the ``full``
        functions are collectives every rank must join)."""
        pieces = []
        for p, off in zip(params, offsets, strict=True):
            start, stop = max(lo, off), min(hi, off + p.numel())
            pieces.append((p, start - off, stop - start) if start < stop else (p, 0, 0))
        return pieces

    def _mine(self, flat: torch.Tensor, g: int) -> torch.Tensor:
        size = self._sizes[g]
        return flat if self.stage == 0 else flat[self.rank * size : (self.rank + 1) * size]

    def before_backward(self, boundary: bool) -> None:
        """Stages 0 and 1: point every ``.grad`` at the flat gradient buffer again
        (``zero_grad`` may have set them to None), so autograd accumulates there, and reduce
        in this backward if it ends the accumulation. Stage 2 reduces in every backward."""
        self.buckets.armed = (self.stage == 2 and not self._holding) or (
            boundary and self.during_backward
        )
        if self.stage == 2:
            return  # autograd makes each gradient; the buckets take them
        for params, views in zip(self.params, self.grad_views, strict=True):
            for p, view in zip(params, views, strict=True):
                if p.grad is not view:
                    p.grad = view

    def after_backward(self, boundary: bool) -> None:
        """The buckets not reduced yet, and every bucket's part into the partitions."""
        self._accumulated = (self.stage < 2 or self._holding) and not boundary
        if self.stage == 2 and self._holding:
            # the full gradients are held, in the accumulation dtype ([Note: holding gradients])
            self.buckets.hold((p for params in self.params for p in params), self._held_dtype)
            return
        if self.stage == 2 and self._held:
            self.buckets.take_left(p for params in self.params for p in params)
            self._held = False
        if self.low_grad_flats and not boundary:
            self.buckets.fold()
            self._drop_grads()  # they read zeros now, as at the boundary
        elif boundary or self.stage == 2:
            self.buckets.finish()
            if self.stage < 2:
                # the gradients are in the partitions now (safe_get_full_grad reads them), and
                # the buffer behind .grad is zeroed for the next accumulation: a .grad read now
                # would be zeros and a write would leak into the next step, so there is none,
                # as DeepSpeed's ZeRO optimizers leave it
                self._drop_grads()

    def hold_gradients(self, hold: bool) -> None:
        """[Note: holding gradients] Inside ``coalesce_grad_reduction`` (and ``no_sync``) the
        backward passes reduce nothing: at stages 0 and 1 the gradients sum in the flat buffer
        as in any accumulation (the engine calls them no boundary); at stage 2 the bucket hooks
        stand aside and each backward's full gradients are summed apart, in the accumulation
        dtype (``grad_accum_dtype``; the parameters' by default, as DeepSpeed's), and
        `reduce_held` (or a reducing backward's hooks) takes them into the buckets: a full
        gradient's memory, for no communication until the end. Stage 3's is zpartition's
        [Note: gradient sync]. ``no_sync`` is stages 0 and 1's only, as DeepSpeed's."""
        self._holding = hold
        self._held = self._held or (hold and self.stage == 2)

    def reduce_held(self) -> None:
        """Reduce what backward passes summed without reducing, now, as a reducing backward
        would have (``coalesce_grad_reduction``'s end)."""
        self._holding = False
        if self.stage == 2:
            self.buckets.armed = True
        self.after_backward(True)

    def discard_accumulated(self) -> None:
        """Drop the gradients backward passes before the boundary summed (``zero_grad``
        between micro-batches, as DeepSpeed's drops them); nothing when there are none."""
        if not self._accumulated:
            return  # after a step the reduction zeroed the buffers already
        if self.stage == 2:
            self.buckets.held.clear()  # what backward passes held ([Note: holding gradients])
            self._held = False
        for flat in [*self.grad_flats, *self.low_grad_flats]:
            flat.zero_()
        self._accumulated = False

    def fold(self) -> None:
        """A pipeline's micro-batch has its weight gradients: add them into the wide
        accumulation buffers and zero the compute-dtype ones (nothing without those)."""
        for wide, low in zip(self.grad_flats, self.low_grad_flats, strict=False):
            wide.add_(low)
            low.zero_()

    def accumulated_grad(self, param: nn.Parameter) -> torch.Tensor:
        """`param`'s gradient accumulated so far in this rank's full gradient buffers (stages
        0 and 1): its ``.grad``, or its view of the wide buffer when the ``.grad`` are of the
        compute dtype and folded into that."""
        if not self.low_grad_flats:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            return param.grad
        g, off = self._offset_of[id(param)]
        return self.grad_flats[g][off : off + param.numel()].view_as(param)

    def _drop_grads(self) -> None:
        for params in self.params:
            for p in params:
                p.grad = None

    def remove(self) -> None:
        """Take the gradient hooks off (the engine's ``destroy``)."""
        self.buckets.remove()

    def tiles(self) -> list[list[nn.Parameter]] | None:
        """None: the step goes whole (one flat master per group; no tiles at stages 0-2)."""
        return None

    def before_step(self, params: Sequence[nn.Parameter] | None = None) -> None:
        pass

    def after_step(self) -> None:
        pass

    def read_back(self, params: Sequence[nn.Parameter] | None = None) -> None:
        """The parameters into this rank's masters, the inverse of `write_back` (nothing to do
        when the fp32 parameters are their own masters); all of them (no tiles here)."""
        if self.aliased:
            return
        for g, flat in enumerate(self.flats):
            self.partitions.masters[g].copy_(self._mine(flat, g))

    def write_back(self, params: Sequence[nn.Parameter] | None = None) -> None:
        """Copy the updated masters into the parameters (all-gathering the partitions)."""
        for g, flat in enumerate(self.flats):
            master = self.partitions.masters[g]
            if self.stage == 0:
                if not self.aliased:
                    flat.copy_(master)
                continue
            # a copy: the input must not lie inside the output (it does when aliased)
            mine = master.to(flat.device, flat.dtype, copy=True)
            zcomm.all_gather_into_tensor(flat, mine, group=self.group)


class ShardedLayout:
    """Stage 3: zpartition's shards, with the fp32 masters and gradients kept here."""

    def __init__(
        self,
        groups: Sequence[Sequence[nn.Parameter]],
        *,
        group: dist.ProcessGroup | None,
        device: torch.device,
        grad_dtype: torch.dtype,
        master_device: torch.device | None = None,
        own_masters: bool = False,
        units: Sequence[zpartition.Unit] = (),
        sub_group_size: int = 1_000_000_000,
    ) -> None:
        self.params = [cast("list[ZeroParameter]", list(g)) for g in groups]
        # no flat parameter or gradient buffers: zpartition's shards and its gradient buckets
        self.flats: list[torch.Tensor] = []
        self.grad_flats: list[torch.Tensor] = []
        self.low_grad_flats: list[torch.Tensor] = []
        every = [p for g in self.params for p in g]
        shard_device = every[0].ds_tensor.device if every else device
        master_device = master_device or shard_device
        # fp32 shards are their own masters: the optimizer steps them in place, no copy
        self.aliased = (
            not own_masters
            and master_device == shard_device
            and all(p.ds_tensor.dtype == torch.float32 for p in every)
        )
        self._master_device = master_device
        self.units = list(units)  # zpartition's, in model order
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._tiles = self._cut(sub_group_size, every)
        tile_of = {id(p): k for k, tile in enumerate(self._tiles) for p in tile}
        self._tile_of = tile_of
        # offload_optimizer to NVMe in tiles: each tile's gradients go to a file once final, in
        # the boundary's backward ([Note: gradients beyond memory]); set by the optimizer
        self.grad_swap: GradientSwap | None = None
        self._swapping = False  # in a boundary's backward, with `grad_swap`
        self._arrived: list[set[int]] = []  # per tile, ids of parameters whose gradient came
        self._needed: list[int] = []  # per tile, the arrivals that complete it
        rank = dist.get_rank(group)
        pieces = [
            [(p, rank * p.ds_tensor.numel(), p.ds_tensor.numel()) for p in g] for g in self.params
        ]
        sizes = [sum(n for _, _, n in g) for g in pieces]
        # DeepSpeed's sub-groups: each group's parameters cut where the tiles are, in order
        self.sub_groups: list[list[ZeroParameter]] = [
            run for g in self.params for run in _runs(g, tile_of)
        ]
        #: per sub-group, the flat fp32 masters the optimizer steps (none when aliased)
        self.sub_group_flats: list[torch.Tensor] = []
        self.partitions = Partitions(
            pieces, master_device, sizes, grad_dtype, shards=self._masters_of(pieces)
        )
        self._grads = {id(p): self.partitions.grad_of(p) for p in every}
        # by id of a gradient group's parameters: what `sink` adds them into
        self._sink_targets: dict[int, _SinkTarget] = {}
        self._shards = [p.ds_tensor for p in every]
        self._masters = [self.partitions.master_of(p) for p in every]
        # id(param) -> (its shard, its master): a tile's write-back looks up only its own
        self._pair_of = {
            id(p): (shard, master)
            for p, shard, master in zip(every, self._shards, self._masters, strict=True)
        }
        self._same_device = master_device == shard_device  # foreach copies need one device
        # set with offload_param to NVMe: its shards must be in memory for the step
        self.partitioned: zpartition.Partitioned | None = None
        # the partitioned model's journal of shards written through `ds_tensor` (set by
        # initialize), and the written parameters whose masters are still to be re-read
        self.take_written: Callable[[], list[ZeroParameter]] | None = None
        self._written: dict[int, ZeroParameter] = {}
        self.shard_store: NvmeShardStore | None = None
        # the units of the tile being stepped that its write-back reclaims, unread ([Note:
        # shards the step overwrites])
        self._overwrite: list[zpartition.Unit] = []
        # hybrid sharding: averages the gradient partition across the replicas (zpartition's
        # `Partitioned.all_reduce_replicas`), once per accumulation, at its last backward
        self.all_reduce_replicas: Callable[[Sequence[torch.Tensor]], None] | None = None
        # the partitioned model, whose backward passes hold or reduce the gradients
        self.model: zpartition.Partitioned | None = None
        # masters of their own for NVMe (offload_optimizer): read from the shards tile by tile
        # as the swapper first writes them out (`ZeroOptimizer.swap_out_states`), so they are
        # never all in memory at once ([Note: building beyond memory] in zengine.zero)
        self.masters_unread = own_masters and not self.aliased
        if not self.masters_unread:
            self.read_back()

    def _cut(self, numel: int, every: list[ZeroParameter]) -> list[list[nn.Parameter]]:
        """[Note: tiled steps] The parameters in their order (group by group, as the gradients
        lie), cut where a tile would pass `numel` shard elements, between units where it can
        (a unit's parameters in two groups may fall in two tiles); one tile without units."""
        if not self.units:
            return [list(every)]
        tiles: list[list[nn.Parameter]] = []
        size, last = 0, None
        for p in every:
            count, unit = p.ds_tensor.numel(), self._unit_of.get(id(p))
            if not tiles or (size + count > numel and size > 0 and unit is not last):
                tiles.append([])
                size = 0
            tiles[-1].append(p)
            size += count
            last = unit
        return tiles

    def _masters_of(
        self, pieces: list[list[tuple[ZeroParameter, int, int]]]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each parameter's master and the tensor the optimizer steps for it: its fp32 shard
        itself (aliased), or a view of one flat fp32 buffer per sub-group (a group's parameters
        in one tile), as DeepSpeed's (large buffers of their own: NVMe offload empties and
        refills them whole)."""
        if self.aliased:
            return {id(p): (p.ds_tensor, p.ds_tensor) for g in pieces for p, _, _ in g}
        found = {}
        device = self._master_device
        for run in self.sub_groups:
            numel = sum(p.ds_tensor.numel() for p in run)
            flat = torch.empty(numel, dtype=torch.float32, device=device)
            self.sub_group_flats.append(flat)
            offset = 0
            for p in run:
                n = p.ds_tensor.numel()
                found[id(p)] = (flat[offset : offset + n], flat)
                offset += n
        return found

    def sink(self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
        """zpartition's gradient sink: accumulate reduced shard gradients in fp32. What a
        group's parameters add into is looked up once per group (zpartition hands a group over
        as the same tuple each time), and added with one foreach call when the gradients lie
        on the masters' device (foreach promotes a narrower dtype as ``add_`` does)."""
        found = self._sink_targets.get(id(params))
        if found is None or found[0] is not params:
            found = self._sink_target(params)
            if isinstance(params, tuple):  # a list may be a new one each call: not kept
                self._sink_targets[id(params)] = found
        _, picked, masters, device = found
        chosen = grads if picked is None else [grads[i] for i in picked]
        if not chosen:
            return
        swap = self.grad_swap if self._swapping else None
        if swap is not None:
            chosen_params = params if picked is None else [params[i] for i in picked]
            masters = list(masters)
            for i, p in enumerate(chosen_params):
                k = self._tile_of.get(id(p))
                if k is None or not swap.away[k]:
                    continue
                aside = swap.late_target(id(p))
                if aside is not None:
                    masters[i] = aside  # a persistent parameter's, its tile on disk
                else:
                    swap.fetch(k)  # a second gradient after the tile went out: back first
        if device is not None and chosen[0].device == device:
            torch._foreach_add_(masters, list(chosen))
        else:
            for mine, grad in zip(masters, chosen, strict=True):
                _add_into(mine, grad)
        if swap is not None:
            self._note_arrived(params, swap)

    def _note_arrived(self, params: Sequence[nn.Parameter], swap: GradientSwap) -> None:
        """[Note: gradients beyond memory] A tile whose every gradient has arrived goes out."""
        for p in params:
            k = self._tile_of.get(id(p))
            if k is None:
                continue
            arrived = self._arrived[k]
            arrived.add(id(p))
            if len(arrived) >= self._needed[k]:
                swap.put_away(k, self._late(k))

    def _late(self, k: int) -> dict[int, torch.Tensor]:
        """Tile `k`'s persistent parameters whose gradients have not arrived: their views."""
        arrived = self._arrived[k]
        return {
            id(p): self._grads[id(p)]  # type: ignore[misc]
            for p in self._tiles[k]
            if id(p) not in arrived and self._persistent(p)
        }

    def _persistent(self, p: nn.Parameter) -> bool:
        unit = self._unit_of.get(id(p))
        return unit is not None and unit.persistent

    def _sink_target(self, params: Sequence[nn.Parameter]) -> _SinkTarget:
        """(`params`, the indices of those with a master (None: all), their masters, and the
        masters' device when they share one)."""
        found = [self._grads.get(id(p)) for p in params]
        picked = [i for i, mine in enumerate(found) if mine is not None]  # frozen: no master
        masters = [mine for mine in found if mine is not None]
        devices = {m.device for m in masters}
        device = devices.pop() if len(devices) == 1 else None
        return params, None if len(picked) == len(params) else picked, masters, device

    def before_backward(self, boundary: bool) -> None:
        if self.model is not None:
            # node-local accumulation reduces across the nodes in the boundary's backward
            # (with replicas and this sink, zpartition leaves that to `after_backward`)
            self.model.set_requires_all_reduce(boundary)
        self._swapping = boundary and self.grad_swap is not None
        if self._swapping:
            self._arrived = [set() for _ in self._tiles]
            # a tile goes out once its parameters outside the persistent unit have arrived
            self._needed = [sum(not self._persistent(p) for p in tile) for tile in self._tiles]
        if boundary and self.shard_store is not None and len(self._tiles) == 1:
            # offload_param to NVMe: the step needs every shard right after this backward, so
            # the shards its modules release stay in memory instead of a write-free trip to
            # disk and an immediate read back
            self.shard_store.holding = True

    def after_backward(self, boundary: bool) -> None:
        if self._swapping and self.grad_swap is not None:
            self._swapping = False
            for k in range(len(self._tiles)):  # tiles with a parameter that had no gradient
                self.grad_swap.put_away(k, self._late(k))
        # zpartition reduced the gradients within the shard group during backward; with
        # replicas, what the accumulation gathered crosses the replicate group once, now
        if boundary and self.all_reduce_replicas is not None:
            self.all_reduce_replicas([self.partitions.grad_partitions_flat_buffer])

    def hold_gradients(self, hold: bool) -> None:
        """Backward passes that hold their full gradients instead of reducing them, or not
        (zpartition's [Note: gradient sync])."""
        if self.model is not None:
            self.model.set_requires_gradient_sync(not hold)

    def reduce_held(self) -> None:
        """Reduce what backward passes held, now: into the partitions, and with replicas
        across them, as the boundary's backward would."""
        if self.model is not None:
            self.model.set_requires_gradient_sync(True)
            self.model.set_requires_all_reduce(True)
            self.model.sync_gradients()
        self.after_backward(True)

    def discard_accumulated(self) -> None:
        # every backward reduced into the partitions, which zero_grad zeroes, or held
        if self.model is not None:
            self.model.drop_unsynced_gradients()

    def remove(self) -> None:
        """Nothing to take off: the gradient hooks are zpartition's, removed with the model's."""

    def tiles(self) -> list[list[nn.Parameter]] | None:
        """The step's tiles ([Note: tiled steps]); None for a single one."""
        return self._tiles if len(self._tiles) > 1 else None

    def before_step(self, params: Sequence[nn.Parameter] | None = None) -> None:
        """offload_param to NVMe: the shards the step writes into (these, or all) in memory;
        then the masters of those shards written through ``ds_tensor`` since the last step
        re-read from them."""
        if self.shard_store is not None:
            self.shard_store.holding = False  # each tile's shards go back after it
            # in a tiled step, written while the next tile steps ([Note: writing shards behind])
            self.shard_store.write_behind = params is not None
        units = self._units_of(params)
        self._take_written()
        store = self.shard_store
        if units is not None and params is not None and store is not None and not self.aliased:
            # [Note: shards the step overwrites]: not read, reclaimed by `write_back`
            stepped = {id(p) for p in params}
            self._overwrite = [u for u in units if self._overwritten(u, stepped)]
            skipped = {id(u) for u in self._overwrite}
            units = [u for u in units if id(u) not in skipped]
        if self.partitioned is not None:
            self.partitioned.fetch_shards(units)
        self._read_written(params)

    def _overwritten(self, unit: zpartition.Unit, stepped: set[int]) -> bool:
        """Whether the write-back of the `stepped` parameters (ids) overwrites every parameter
        of `unit`'s shard, which the store keeps and none of which was written through
        ``ds_tensor``."""
        if unit.store is not self.shard_store or unit.codes is not None:
            return False
        return all(
            id(p) in stepped and id(p) in self._pair_of and id(p) not in self._written
            for p in unit.params
        )

    def _read_written(self, params: Sequence[nn.Parameter] | None) -> None:
        """A shard written through ``ds_tensor`` (DeepSpeed code writes ``param.ds_tensor.data
        = t``) into its master, before the step (of these parameters, or all) would write the
        old master back over it; fp32 shards that are their own masters hold the write
        already. Nothing is done while nothing was written (`before_step` has taken the
        writes)."""
        if not self._written or self.aliased:
            self._written.clear()
            return
        keys = list(self._written) if params is None else [id(p) for p in params]
        # a frozen parameter has no master: its shard, written, is all there is
        due = [key for key in keys if self._written.pop(key, None) is not None]
        pairs = [self._pair_of[key] for key in due if key in self._pair_of]
        if pairs:
            self._copy([m for _, m in pairs], [s for s, _ in pairs])  # type: ignore[misc]

    def _take_written(self) -> None:
        """The parameters written through ``ds_tensor`` since last asked, noted."""
        if self.take_written is not None:
            for p in self.take_written():
                self._written[id(p)] = p

    def read_back(self, params: Sequence[nn.Parameter] | None = None) -> None:
        """The shards (of these parameters, or all) into the masters, the inverse of
        `write_back` (nothing to do when the fp32 shards are their own masters); a tile at a
        time, the shards a store keeps fetched for it and put back after."""
        if self.aliased:
            return
        if params is None:
            self.masters_unread = False
        for tile in self._tiles if params is None else [params]:
            units = [u for u in self._units_of(tile) or [] if u.store is not None]
            for u in units:
                u.bring_in()
            pairs = [self._pair_of[id(p)] for p in tile]
            self._copy([m for _, m in pairs], [s for s, _ in pairs])  # type: ignore[misc]
            for u in units:
                if u.status is zpartition.ZeroParamStatus.NOT_AVAILABLE:
                    u.put_away()

    def write_back(self, params: Sequence[nn.Parameter] | None = None) -> None:
        """The updated masters (of these parameters, or all) into the shards; with offload_param
        to NVMe, those shards back to their files."""
        overwrite, self._overwrite = self._overwrite, []
        if overwrite and self.shard_store is not None:
            # in memory only now, just before they are overwritten ([Note: shards the step
            # overwrites]): a step that raised before this left them in their files
            self.shard_store.reclaim([u.shard for u in overwrite])
        if self.aliased:
            pass  # the step updated the shards themselves
        elif params is None:
            self._copy(self._shards, self._masters)  # type: ignore[arg-type]
        else:
            pairs = [self._pair_of[id(p)] for p in params]
            self._copy([d for d, _ in pairs], [m for _, m in pairs])  # type: ignore[misc]
        if self.partitioned is not None:
            self.partitioned.evict_shards(self._units_of(params))

    def after_step(self) -> None:
        """offload_param to NVMe: shards read ahead during a tiled step for the next forward
        go back too; between steps only the persistent unit's stay in memory."""
        if self.partitioned is not None and len(self._tiles) > 1:
            self.partitioned.evict_shards()
        if self.shard_store is not None:
            self.shard_store.write_behind = False  # the writes in flight finish on their own

    def _units_of(self, params: Sequence[nn.Parameter] | None) -> list[zpartition.Unit] | None:
        if params is None:
            return None
        seen = {id(self._unit_of[id(p)]): self._unit_of[id(p)] for p in params}
        return list(seen.values())

    def _copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        if self._same_device:
            torch._foreach_copy_(dst, src)
            return
        for d, s in zip(dst, src, strict=True):
            # torch's own copy_: a shard's (`ShardTensor.copy_`) would log the engine's write
            # back as a user's write, and the next step re-read the masters from rounded shards.
            # Blocking: NVMe offload may empty the masters right after.
            torch.Tensor.copy_(d, s)


def _runs(params: Sequence[ZeroParameter], tile_of: dict[int, int]) -> list[list[ZeroParameter]]:
    """`params` (one optimizer group's) split by the tile each is stepped in."""
    runs: dict[int, list[ZeroParameter]] = {}
    for p in params:
        runs.setdefault(tile_of.get(id(p), 0), []).append(p)
    return list(runs.values())
