"""One unit of communication: parameters gathered, released and reduced together.

[Note: unit layout]
A parameter of n elements is cut into W chunks of c = ceil(n / W) elements (the last rank's
padded) and this rank keeps chunk r as ``ds_tensor``. A unit keeps its parameters' chunks back
to back in one byte buffer, the *shard*, so its all-gather is one collective of bytes whatever
the dtypes. The gathered bytes are rank-major (rank 0's shard, rank 1's shard, ...); parameter
i's full data is the column block i of them viewed as (W, shard bytes), copied once into the
*full* buffer, where each parameter lies contiguous.

A parameter whose ``comm_dtype`` is narrower than its dtype (autocast's lower-precision-safe
modules: fp32 weights that autocast casts to bf16 anyway) is gathered in that dtype for the
forward and backward passes: a *wire* copy of the shard carries it, half the bytes, and the
copy-out widens it into the full buffer, whose values are then the ones autocast computes
with. Every other gather (``GatheredParameters``, a persistent unit, taking the hooks off) is
exact, and a unit still holding narrowed (or quantized) values is gathered again before it
is read there.

The full buffer is freed by resizing its storage to 0 bytes, not by dropping it: autograd keeps
views of it (``addmm`` saves ``weight.t()``), and resizing frees the memory under those views,
while the gather before backward fills the same storage again (FSDP2 frees the same way). With
one rank and the shard on the compute device, the shard *is* the full data: nothing is copied.

With a secondary partition, a forward's gather keeps some of its rows, and the backward gathers
them within a node instead of the rows of every rank: [Note: secondary partition]
(`_secondary.py`). With quantized weights, a pass's gathers send int8 codes instead of the
shards: [Note: quantized weights]; a frozen unit may keep its shard as int8 codes, and every
gather of it sends those: [Note: quantized frozen weights] (`_stored_codes.py`).

[Note: quantized weights]
ZeRO++'s qwZ (DeepSpeed's ``zero_quantized_weights``, ``ZeroParamConfig.quantized_weights``):
the gathers of the forward and backward passes (the `Coordinator`'s fetches and prefetches)
carry each rank's shard as int8 codes with one float32 scale per block of
``quantized_weights_block_size`` elements (`zcomm.all_gather_quantized`), about 1/4 of fp32's
bytes (1/2 of bf16's), and every rank's full buffer holds the dequantized rows, its own row
included, so that every rank computes with the same weights. Each element is within half its
block's scale of the shard's. Only the communicated copy is quantized: the shards (the fp32
masters the optimizer steps) are only read, and the full buffer is marked inexact, as a narrow
gather's is, so that `GatheredParameters`, ``param.all_gather()`` and taking the hooks off
(`make_exact`) gather it again exactly before reading it; their own gathers never quantize.

Which units: a unit's shard is a byte buffer, and the quantizer reads one floating dtype, so a
unit whose parameters share one dtype of float32, bfloat16, float16 or float64 is quantized as
its whole shard viewed in that dtype (the alignment padding between chunks holds zeros, which
cost nothing but their codes); a unit mixing dtypes, or holding a parameter of another dtype,
is gathered as before (exact, or through its wire copy). Quantizing takes precedence over
``comm_dtype``'s narrowing: an fp32 unit autocast computes in bf16 sends int8 codes, a quarter
of its bytes rather than a half, dequantized into fp32. A gather of fewer elements than a block
is one block of its own size: nothing is padded, so a small unit sends a byte per element too.
Units of the same dtype in one batch go in one quantized all-gather of their shards side by
side, so the blocks run across units and a unit's values depend on which units it was gathered
with (DeepSpeed's coalesced qwZ gather does the same): its backward may compute with weights a
rounding apart from its forward's when the batches differ; units of another dtype, and those
falling back, go in gathers of their own. Persistent units are gathered exactly (`refresh`,
once per optimizer step: small by the persistence threshold, read in place), and so are units
on one rank (`direct`: nothing goes).
A secondary shard ([Note: secondary partition]) keeps the rows a quantized forward gathered,
dequantized, and the backward gathers those exactly within the node: the backward computes
with the forward's weights, as with narrow gathers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import zcomm
from zpartition._channel import Channel, Kind
from zpartition._errors import ZeroParamError
from zpartition._param import ZeroParameter
from zpartition._shard import ShardTensor, make_shard, retire
from zpartition._status import ZeroParamStatus
from zpartition._stepped import watch
from zpartition._store import ShardStore
from zpartition._stored_codes import StoredCodes, joined, quantization_block

__all__ = ["GradKey", "Unit", "fetch_shards", "issue_gathers"]

_ALIGN = 16  # bytes; every parameter's chunk starts aligned for any dtype's view
_QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_AVAILABLE, _NOT_AVAILABLE, _INFLIGHT = (
    ZeroParamStatus.AVAILABLE,
    ZeroParamStatus.NOT_AVAILABLE,
    ZeroParamStatus.INFLIGHT,
)


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


GradKey = tuple[torch.dtype, "torch.dtype | None"]
"""A gradient group's parameters' dtype, and the dtype their ``comm_dtype`` attribute asks
them to be reduced in (None: the config's ``reduce_dtype``, else their own)."""


def comm_dtype(p: torch.Tensor) -> torch.dtype | None:
    """The dtype `p`'s gradient is to be reduced in, by its ``comm_dtype`` attribute
    (DeepSpeed's, set on autocast's lower-precision-safe modules); None when it has none."""
    dtype = getattr(p, "comm_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _narrow_dtype(p: torch.Tensor) -> torch.dtype | None:
    """The dtype `p` is gathered in for a pass: its ``comm_dtype`` when that is a narrower
    floating dtype than its own, else None (gathered as it is)."""
    comm = comm_dtype(p)
    if comm is None or not p.is_floating_point() or not comm.is_floating_point:
        return None
    return comm if comm.itemsize < p.element_size() else None


def _as(rows: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Gathered bytes as `dtype` (None: as bytes)."""
    return rows if dtype is None else rows.view(dtype)


class _GradGroup:
    """The unit's trainable parameters of one dtype and one ``comm_dtype``, reduce-scattered
    together."""

    __slots__ = (
        "columns",
        "comm",
        "dtype",
        "indices",
        "params",
        "row_split",
        "shard_grad",
        "width",
    )

    def __init__(
        self, key: GradKey, indices: list[int], chunks: list[int], params: list[ZeroParameter]
    ) -> None:
        self.dtype, self.comm = key
        self.indices = indices
        # its parameters, one tuple for the unit's life (a gradient sink may key on it)
        self.params = tuple(params[i] for i in indices)
        self.columns: list[tuple[int, int]] = []  # (offset, chunk) in the rank-major rows
        # each parameter's full rows of chunks, and the elements in its part-filled row after
        # them (the rest of that row, and any rows below, are padding)
        self.row_split: list[tuple[int, int]] = []
        self.width = 0
        for i in indices:
            self.columns.append((self.width, chunks[i]))
            self.row_split.append(divmod(int(params[i].ds_numel), chunks[i]))  # chunks are >= 1
            self.width += chunks[i]
        self.shard_grad: torch.Tensor | None = None  # this rank's gradients, one flat tensor


class _Gather:
    """One all-gather of several units' shards, laid side by side; each unit copies its part
    out when it is first needed (rows are ranks, each row every unit's shard in turn; in a
    secondary group's gather, each row k ranks' rows of every unit in turn)."""

    __slots__ = ("_gathered", "_handle", "_ranks")

    def __init__(self, handle: zcomm.Handle, gathered: torch.Tensor, ranks: int) -> None:
        self._handle: zcomm.Handle | None = handle
        self._gathered = gathered
        self._ranks = ranks

    def rows(self) -> torch.Tensor:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        return self._gathered.view(self._ranks, -1)


class _Pending:
    """A unit's part of a gather in flight: where it lies, and what to do with it."""

    __slots__ = ("gather", "inexact", "keep", "secondary", "start", "wire")

    def __init__(
        self,
        gather: _Gather,
        start: int,
        wire: bool,
        keep: int | None,
        secondary: bool,
        inexact: bool,
    ) -> None:
        self.gather = gather
        self.start = start  # its first byte in each row
        self.wire = wire  # it carries the wire copy (narrowed chunks)
        self.keep = keep  # keep a secondary shard, of the shards at this version (None: not)
        self.secondary = secondary  # the rows come from the secondary group's shards
        # the rows are not the shards' exact values: narrowed, or quantized and dequantized
        self.inexact = inexact


class _Secondary(NamedTuple):
    """A secondary shard ([Note: secondary partition]): k rows of a forward's gather."""

    rows: torch.Tensor  # k rows of the unit's gathered bytes, back to back
    wire: bool  # they are wire bytes (the forward gathered narrowed chunks)
    version: int  # the shards' version they were gathered from
    inexact: bool  # narrowed or dequantized values, not the shards' ([Note: quantized weights])


def fetch_shards(units: Sequence[Unit]) -> None:
    """Bring back the shards of `units` that a `ShardStore` keeps (one store per model), or
    that are kept as codes ([Note: quantized frozen weights])."""
    for u in units:
        if u.codes is not None:
            u.codes.bring_in(u.shard)
    stored = [u for u in units if u.store is not None and u.codes is None]
    if stored:
        store = stored[0].store
        assert store is not None
        store.fetch([u.shard for u in stored])


_COALESCE_BYTES = 32 << 20
"""Gathered bytes one collective holds at most. A gather of several units pays one latency,
but its buffer lives until the last of them copies its part out, beside their full buffers;
past a few MiB a collective is bandwidth-bound anyway, so a larger set goes as several gathers
and the copy-out never holds more than this twice (a prefetch bucket of 5e7 fp32 elements
would otherwise hold 200 MB twice through a forward)."""


def issue_gathers(
    units: Sequence[Unit],
    *,
    narrow: bool = False,
    keep: bool = False,
    secondary: bool = False,
    quantize: int | None = None,
) -> None:
    """Start the all-gather of `units` (agreed with the other ranks first), small units
    together: a prefetch bucket of many small modules costs one collective's latency, not
    one each. `narrow`: for a pass, the parameters with a narrower ``comm_dtype`` in it.
    `keep`: each unit with a secondary group keeps its secondary shard of what comes;
    `secondary`: gather the units' secondary shards within their secondary group instead
    ([Note: secondary partition]). `quantize`: for a pass, the units of one floating dtype
    go quantized in blocks of this many elements, a gather per dtype ([Note: quantized
    weights]); None: every shard goes as it is (or narrowed). Units kept as codes send them,
    whatever the call ([Note: quantized frozen weights])."""
    if not secondary:  # offloaded shards come back first (secondaries and codes need none)
        fetch_shards([u for u in units if u.codes is None])
    # batches by how they go: None exact (or narrowed); (quantized, a dtype, a block size),
    # quantized now or (False) kept as codes
    batches: dict[_How, tuple[list[tuple[Unit, bool]], int]] = {}
    for u in units:
        u.channel.count_live(0 if u.persistent else u.numel)
        if u.direct:
            u._show()
            continue
        how: _How = None
        if secondary:
            assert u.secondary is not None
            wire = u.secondary.wire
        elif u.codes is not None:  # its codes go, with those of its dtype and block size
            how, wire = (False, u.codes.dtype, u.codes.codes.block_size), False
        elif quantize is not None and u.quantizable is not None:
            how, wire = (True, u.quantizable, quantize), False  # the shard goes, quantized
        else:
            wire = narrow and u.wire_bytes is not None  # else the shard goes as it is
        nbytes = u.channel.size * u.row_bytes(wire)  # the same from either group
        batch, held = batches.get(how, ([], 0))
        if batch and held + nbytes > _COALESCE_BYTES:
            _gather_together(batch, keep=keep, secondary=secondary, quantize=_block(how, quantize))
            batch, held = [], 0
        batch.append((u, wire))
        batches[how] = (batch, held + nbytes)
    for how, (batch, _) in batches.items():
        if batch:
            _gather_together(batch, keep=keep, secondary=secondary, quantize=_block(how, quantize))


_How = tuple[bool, torch.dtype, int] | None
"""How a batch of `issue_gathers` goes: None as it is; (True, dtype, block size) quantized
now, (False, dtype, block size) as the codes its units keep."""


def _block(how: _How, quantize: int | None) -> int | None:
    """The block size a batch of `issue_gathers` goes quantized in now (None: it goes exact,
    or as stored codes)."""
    return quantize if how is not None and how[0] else None


def _gather_together(
    units: list[tuple[Unit, bool]],
    *,
    keep: bool = False,
    secondary: bool = False,
    quantize: int | None = None,
) -> None:
    """One all-gather of the shards (or, with the flag, the narrow wire copies) of `units`,
    laid side by side, left in flight; with `secondary`, of their secondary shards within
    their secondary group; with `quantize`, of their shards (all of `units`' one quantizable
    dtype) quantized in blocks of that many elements and dequantized on arrival; units kept
    as codes (all or none of `units`) send them ([Note: quantized frozen weights])."""
    first = units[0][0]
    channel, device = (first.hpz if secondary else first.channel), first.device
    assert channel is not None
    handle: zcomm.Handle
    if first.codes is not None and not secondary:  # rows of their dequantized values
        stored = [u.codes for u, _ in units if u.codes is not None]
        codes = joined(stored, device)
        full = torch.empty(channel.size * codes.numel, dtype=codes.dtype, device=device)
        handle = zcomm.all_gather_quantized(full, codes, group=channel.group, async_op=True)
        gathered = full.view(torch.uint8)
        sizes = [s.codes.numel * s.dtype.itemsize for s in stored]
    else:
        sources = [
            u.secondary.rows
            if secondary and u.secondary is not None
            else (u.wire() if wire else u.shard)
            for u, wire in units
        ]
        sources = [t if t.device == device else t.to(device) for t in sources]
        source = sources[0] if len(sources) == 1 else torch.cat(sources)
        sizes = [t.numel() for t in sources]
        if quantize is None:
            gathered = source.new_empty(channel.size * source.numel())
            handle = zcomm.all_gather_into_tensor(
                gathered, source, group=channel.group, async_op=True
            )
        else:  # the same rows of bytes, of dequantized values: [Note: quantized weights]
            dtype = first.quantizable
            assert dtype is not None
            assert not secondary
            values = source.view(dtype)  # the shards read, never written
            full = values.new_empty(channel.size * values.numel())
            block = quantization_block(quantize, values.numel())  # a small gather: one block
            handle = zcomm.all_gather_quantized(
                full, values, bits=8, block_size=block, group=channel.group, async_op=True
            )
            gathered = full.view(torch.uint8)
    gather, start = _Gather(handle, gathered, channel.size), 0
    for (u, wire), size in zip(units, sizes, strict=True):
        # the shards' version now: what the secondary shard will be a copy of
        version = u.shard._version if keep and u.hpz is not None else None
        if secondary:
            assert u.secondary is not None
            inexact = u.secondary.inexact
        else:
            inexact = wire or quantize is not None
        u._pending = _Pending(gather, start, wire, version, secondary, inexact)
        start += size
        u.status = _INFLIGHT
        for p in u.params:
            p.ds_status = _INFLIGHT


class Unit:
    """The parameters of one module (or of a leaf's or a group's subtree) and their storage."""

    def __init__(
        self,
        uid: int,
        name: str,
        params: Sequence[ZeroParameter],
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
        self._pending: _Pending | None = None  # the gather in flight
        # the secondary group (None: no secondary partition, or a persistent unit) and the
        # secondary shard held from a forward: [Note: secondary partition]
        self.hpz: Channel | None = None
        self.secondary: _Secondary | None = None
        # the full buffer holds values gathered narrow or quantized (for a pass), not the
        # shards' exact ones
        self.inexact = False
        self.numel = sum(int(p.ds_numel) for p in self.params)
        self.ready = 0  # trainable parameters whose gradient arrived in this backward
        self._gathered_version = -1  # the shards' version at the last refresh
        # the shard kept as int8 codes instead: [Note: quantized frozen weights]
        self.codes: StoredCodes | None = None
        # the ranks holding the same chunks in the other shard groups: GatheredParameters'
        # changes are made equal across them too ([Note: hybrid sharding]); None: no replicas
        self.replicate: dist.ProcessGroup | None = None
        # where `ds_tensor.data = t` and `.copy_(t)` name their parameter: a partitioned model's
        # list (`Partitioned.take_written`), None for units of `Init` alone
        self.journal: list[ZeroParameter] | None = None
        world = channel.size
        self.chunks = [math.ceil(int(p.ds_numel) / world) for p in self.params]
        self.store: ShardStore | None = None  # where the shard waits while released, if away
        self._build_shard()
        # one rank with the shard on the compute device: the shard is the full data
        self.direct = world == 1 and self.shard.device == device
        self.narrow = [_narrow_dtype(p) for p in self.params]
        # the dtype a pass may quantize the whole shard in: [Note: quantized weights]
        dtypes = {p.dtype for p in self.params}
        self.quantizable: torch.dtype | None = None
        if not self.direct and len(dtypes) == 1 and next(iter(dtypes)) in _QUANTIZABLE:
            self.quantizable = next(iter(dtypes))
        self._build_wire()
        self._build_full()
        self.empties = [torch.empty(0, dtype=p.dtype, device=device) for p in self.params]
        trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.trainable = len(trainable)
        keys = {i: (self.params[i].dtype, comm_dtype(self.params[i])) for i in trainable}
        self.grad_groups = [
            _GradGroup(k, [i for i in trainable if keys[i] == k], self.chunks, self.params)
            for k in sorted(set(keys.values()), key=str)
        ]
        for p in self.params:
            p.ds_unit = self
            p.ds_status = _NOT_AVAILABLE
            p.ds_active_sub_modules = self.users
        self.put_away()  # with a store (inherited from `Init`'s units): away at once

    # -- storage ---------------------------------------------------------------------------

    def _build_shard(self) -> None:
        """Copy each parameter's chunk into one byte buffer; ``ds_tensor`` becomes a view."""
        offsets, end = [], 0
        for p, c in zip(self.params, self.chunks, strict=True):
            offsets.append(end)
            end = _aligned(end + c * p.element_size())
        # units built under `Init` whose shards wait in a store: fetched to be copied here, and
        # this unit's shard goes to the same store once built (`Init`'s ``shard_store``)
        old = {id(u): u for p in self.params if (u := getattr(p, "ds_unit", None)) is not None}
        stored = [u for u in old.values() if u.store is not None and u.codes is None]
        fetch_shards(stored)
        self.store = stored[0].store if stored else None
        first = self.params[0].ds_tensor if self.params else torch.empty(0)
        self.shard = torch.zeros(
            end, dtype=torch.uint8, device=first.device, pin_memory=first.is_pinned()
        )  # pinned shards (parameter offload) copy to the device asynchronously
        self.offsets = offsets
        # each parameter's attributes and its shard, for the check that none was rebound
        self.bound: list[tuple[dict[str, Any], ShardTensor]] = []
        for p, c, off in zip(self.params, self.chunks, offsets, strict=True):
            view = self.shard[off : off + c * p.element_size()].view(p.dtype)
            view.copy_(p.ds_tensor)
            retire(p)  # the shard of an Init unit, if it had one: writes to it would be lost
            shard = make_shard(view, self, p)  # keeps `.data = t` writes: [Note: shard writes]
            p.ds_tensor = shard
            watch(shard)  # a fused optimizer's step must count as a change (_stepped.py)
            self.bound.append((p.__dict__, shard))
        mine = {id(p) for p in self.params}
        for u in stored:
            if any(id(q) not in mine and q.ds_unit is u for q in u.params):
                u.put_away()  # some of its parameters still wait for their new unit
                continue
            discard = getattr(u.store, "discard", None)  # optional in the protocol
            if discard is not None:
                discard(u.shard)
            u.shard.untyped_storage().resize_(0)  # every parameter moved out: not kept twice

    def _build_wire(self) -> None:
        """Where each parameter's chunk lies in the wire copy of the shard (in its narrow
        dtype, if it has one); ``wire_bytes`` None: no parameter is gathered narrow."""
        self.wire_bytes: int | None = None
        self._wire_offsets: list[int] = []
        if self.direct or not any(self.narrow):
            return
        end = 0
        for p, c, narrow in zip(self.params, self.chunks, self.narrow, strict=True):
            self._wire_offsets.append(end)
            end = _aligned(end + c * (narrow or p.dtype).itemsize)
        self.wire_bytes = end

    def row_bytes(self, wire: bool) -> int:
        """The bytes of this unit in one row of a gather (one rank's shard, or its wire copy)."""
        if wire:
            assert self.wire_bytes is not None
            return self.wire_bytes
        return int(self.shard.numel())

    def wire(self) -> torch.Tensor:
        """The shard as a pass gathers it: the narrowed parameters' chunks cast down."""
        assert self.wire_bytes is not None
        wire = torch.empty(self.wire_bytes, dtype=torch.uint8, device=self.shard.device)
        dsts, srcs = [], []
        for p, c, narrow, off in zip(
            self.params, self.chunks, self.narrow, self._wire_offsets, strict=True
        ):
            dtype = narrow or p.dtype
            dsts.append(wire[off : off + c * dtype.itemsize].view(dtype))
            srcs.append(p.ds_tensor)
        torch._foreach_copy_(dsts, srcs)
        return wire

    def _build_full(self) -> None:
        """The full buffer and each parameter's full view of it (the shard itself when direct),
        and how a gather's rows are copied into it: as bytes, or from the wire, widening."""
        world = self.channel.size
        self._copy_plan: list[tuple[torch.Tensor, int, int]] = []
        self._wire_plan: list[tuple[torch.Tensor, int, int, torch.dtype | None]] = []
        if self.direct:
            self.full = self.shard
            # views of the plain byte buffer, not of `ds_tensor`: a view holds its base from
            # C++, where the collector cannot see it, and the base's attributes name this unit
            self.views = [
                self.shard[off : off + c * p.element_size()].view(p.dtype).view(p.ds_shape)
                for p, c, off in zip(self.params, self.chunks, self.offsets, strict=True)
            ]  # c == n with one rank
            return
        starts, end = [], 0
        for p, c in zip(self.params, self.chunks, strict=True):
            starts.append(end)
            end = _aligned(end + world * c * p.element_size())
        self.full = torch.empty(end, dtype=torch.uint8, device=self.device)
        self.views = []
        for i, (p, c, start, off) in enumerate(
            zip(self.params, self.chunks, starts, self.offsets, strict=True)
        ):
            nbytes = c * p.element_size()
            block = self.full[start : start + world * nbytes]
            self.views.append(block.view(p.dtype)[: int(p.ds_numel)].view(p.ds_shape))
            self._copy_plan.append((block.view(world, nbytes), off, nbytes))
            if self.wire_bytes is not None:
                narrow = self.narrow[i]
                dst = block.view(p.dtype).view(world, c) if narrow else block.view(world, nbytes)
                sent = c * narrow.itemsize if narrow else nbytes  # its bytes on the wire
                self._wire_plan.append((dst, self._wire_offsets[i], sent, narrow))
        self._full_bytes = end
        self.full.untyped_storage().resize_(0)

    # -- gather and release ----------------------------------------------------------------

    def issue_gather(self) -> None:
        """Start this unit's all-gather (the caller agreed on it with the other ranks)."""
        issue_gathers([self])

    def wait(self) -> None:
        """Finish the gather: the full parameters are in ``param.data`` afterwards."""
        if self.status is not _INFLIGHT:
            return
        pending, self._pending = self._pending, None
        assert pending is not None
        wire, row = pending.wire, self.row_bytes(pending.wire)
        rows = pending.gather.rows()
        if pending.secondary:
            # (S, k * row): secondary rank j's k rows are the group's rows j*k to j*k + k - 1,
            # so as (S, k, row) they are the primary gather's (W, row), in order
            assert self.hpz is not None
            k = self.channel.size // self.hpz.size
            part = rows[:, pending.start : pending.start + k * row].view(self.hpz.size, k, row)
        else:
            part = rows[:, pending.start : pending.start + row]
            if pending.keep is not None:
                self._keep_secondary(part, wire, pending.keep, pending.inexact)
        self.full.untyped_storage().resize_(self._full_bytes)
        if wire:  # the narrowed chunks widen as they are copied
            dsts = [dst for dst, _, _, _ in self._wire_plan]
            srcs = [_as(part[..., off : off + n], narrow) for _, off, n, narrow in self._wire_plan]
        else:
            dsts = [dst for dst, _, _ in self._copy_plan]
            srcs = [part[..., off : off + n] for _, off, n in self._copy_plan]
        if pending.secondary:  # the (W, ...) destinations as (S, k, ...), like the rows
            dsts = [dst.view(*part.shape[:-1], -1) for dst in dsts]
        torch._foreach_copy_(dsts, srcs)
        self.inexact = pending.inexact
        self._show()

    # -- the secondary shard ([Note: secondary partition]) ---------------------------------

    def _keep_secondary(self, part: torch.Tensor, wire: bool, version: int, inexact: bool) -> None:
        """Copy this rank's k rows of a forward's gathered `part` (W rows) out of the gather's
        buffer, which goes once every unit in it has copied its part."""
        assert self.hpz is not None
        k = self.channel.size // self.hpz.size
        mine = part[self.hpz.rank * k : (self.hpz.rank + 1) * k]
        rows = torch.empty(mine.numel(), dtype=torch.uint8, device=mine.device)
        rows.view(mine.shape).copy_(mine)
        self.secondary = _Secondary(rows, wire, version, inexact)

    def holds_secondary(self) -> bool:
        """Whether a secondary shard of the shards as they are now is held (one kept before
        the shards changed is dropped: the primaries hold the new values)."""
        held = self.secondary
        if held is None:
            return False
        if held.version != self.shard._version:
            self.secondary = None
            return False
        return True

    def drop_secondary(self) -> None:
        self.secondary = None

    @property
    def secondary_bytes(self) -> int:
        """The bytes of the secondary shard held now (0: none)."""
        held = self.secondary
        return 0 if held is None else int(held.rows.numel())

    def make_exact(self) -> None:
        """If the full buffer holds narrowed or quantized values (a pass gathered it), gather
        it again as it is: for readers other than the forward and backward passes
        (``GatheredParameters``, taking the hooks off). Agreed with the other ranks, which all
        hold it alike."""
        if self.status is _INFLIGHT:
            self.wait()
        if self.status is _AVAILABLE and self.inexact:
            self.channel.agree(Kind.GATHER, [self.uid])
            _gather_together([(self, False)])
            self.wait()

    def _show(self) -> None:
        for p, view in zip(self.params, self.views, strict=True):
            p.data = view
            p.ds_status = _AVAILABLE
        self.status = _AVAILABLE

    def release(self, *, give_away: bool = False) -> None:
        """Empty ``param.data`` and free the full buffer (the shards stay). With `give_away`
        the buffer is dropped rather than emptied, and the unit takes a new one: tensors taken
        from the gathered parameters (a ``state_dict()`` inside ``GatheredParameters``) keep
        their values, as with DeepSpeed, and the memory goes with the last of them."""
        if self.status is _NOT_AVAILABLE:
            return
        if self.status is _INFLIGHT:
            self.wait()
        self.channel.count_live(-self.numel if not self.persistent else 0)
        for p, empty in zip(self.params, self.empties, strict=True):
            p.data = empty
            p.ds_status = _NOT_AVAILABLE
        if self.direct:
            pass
        elif give_away:
            self._build_full()
        else:
            self.full.untyped_storage().resize_(0)
        self.status = _NOT_AVAILABLE
        self.inexact = False
        self._gathered_version = -1  # a persistent unit released must be gathered again
        self.put_away()

    def bring_in(self) -> None:
        """The shard in memory, from its store or codes (`fetch_shards` of this unit)."""
        fetch_shards([self])

    def put_away(self) -> None:
        """The shard back to its store, or to codes (a no-op for a shard kept in memory):
        after `fetch_shards`, or as the unit is released."""
        if self.codes is not None:
            self.codes.put_away(self.shard, self.name)
        elif self.store is not None:
            self.store.evict(self.shard)

    def store_quantized(self, block_size: int) -> None:
        """Keep the shard as int8 codes from now on: [Note: quantized frozen weights]."""
        dtype = self.quantizable
        if dtype is None or self.trainable or self.persistent or self.store is not None:
            raise ZeroParamError(
                f"quantized_nontrainable_weights: {self.name!r} is not a frozen unit of one "
                "floating dtype kept in memory across several ranks"
            )
        self.codes = StoredCodes(self.shard, dtype, block_size, self.name)
        if self.status is _NOT_AVAILABLE:
            self.put_away()

    def refresh(self) -> None:
        """Gather again if the shards changed since the last gather (an optimizer stepped);
        for persistent units, which are never released. The shards' version counter says it:
        every rank runs the same optimizer, so every rank decides alike."""
        version = self.shard._version
        if self.direct or version == self._gathered_version:
            if self.status is _NOT_AVAILABLE:
                self._show()
            return
        self.channel.agree(Kind.GATHER, [self.uid])
        self.status = _NOT_AVAILABLE
        self.issue_gather()
        self.wait()
        self._gathered_version = version
