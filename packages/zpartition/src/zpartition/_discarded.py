"""Changes that `GatheredParameters` without ``modifier_rank`` would drop: found, agreed, raised.

[Note: discarded changes]
Without ``modifier_rank`` a ``GatheredParameters`` block is a read: at its end the full
parameters are dropped and the shards stay as they were, so a change made inside is lost on
every rank (and the next gather shows the old values). A change there is a mistake (the user
meant ``modifier_rank=0``), and it is reported instead: `DiscardedChangeError` on every rank of
the group, naming the parameters and the ranks that changed them. DeepSpeed raises a
``RuntimeError`` ("in-place modification") too, but only with ``enable_sanity_checks``, and it
looks at the parameter's version counter only, which writes through ``p.data`` never move.

What is looked at, at the end of the block, on each rank (nothing is copied at entry):

- the parameter's version counter: writes through the parameter or a tensor sharing its
  counter (``p.add_()`` under ``no_grad``, ``p.copy_()``, ``nn.init.*``, ``load_state_dict``,
  ``p.detach()`` and ``state_dict()`` values), free;
- which tensor ``p.data`` is: ``p.data = t`` (a new tensor, a new shape or dtype), free;
- this rank's own chunk of each parameter in the gathered buffer against the shard it was
  gathered from, byte for byte: writes through ``p.data`` (``p.data.mul_()``,
  ``p.data[i] = x``, ``p.data.copy_()``), which bump no counter the block can see (every read
  of ``.data`` is a tensor with a fresh counter). It reads 1/W of the gathered bytes and
  copies nothing. A write must touch this rank's own chunk to be seen here; a write made on
  every rank alike is therefore always seen (some rank owns each element), one made on one rank
  only outside that rank's chunk is not, nor is one that writes the values already there.

Not judged at all: units whose shards were written inside the block (a nested block with
``modifier_rank``, an optimizer step, ``ds_tensor.copy_``: those writes are kept), and units
no longer gathered at the end. Not compared byte for byte: units whose shard is kept as int8
codes ([Note: quantized frozen weights]: the full buffer holds dequantized values) or sits on
another device than the full buffer (offloaded parameters: a comparison there would copy the
chunk across); for those only the counter and ``p.data`` checks hold. With one rank the
block keeps a copy of the shard anyway (the shard *is* the full data), so the comparison is
against that copy: exact, whatever was written.

Agreement: one all-gather of an agreement header's size ([Note: agreement]) per block, after
every block without ``modifier_rank``: a mark, how many parameters this rank saw changed, a
checksum of the block's ``ds_id``s, and up to five changed ``ds_id``s. Every rank then raises
the same error, or none, so a change on one rank raises on all and none waits for another. The
header is the channel's size on purpose: a rank that left the block while another is already
gathering for the next pairs header with header, and both raise a `ZeroParamError` naming
the disagreement instead of hanging or aborting. With hybrid sharding a second collective, a
maximum over the replicate group of one flag per parameter, spreads the error to the other
shard groups. The block's own exception, if one is on its way out, is left to propagate: the
agreement still runs (the other ranks wait for it), but raises nothing over it; unless that
exception is a `ZeroParamError` (ranks disagreed inside the block, and each of them raises
it): the ranks' collectives no longer pair then, and another one could wait for ever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import zcomm
from zpartition._channel import _HEADER, Channel
from zpartition._errors import ZeroParamError
from zpartition._param import ZeroParameter
from zpartition._status import ZeroParamStatus
from zpartition._unit import Unit

__all__ = ["DiscardedChangeError", "Found", "Snapshot", "discarded_error"]

_MARK = 0x6564  # the header's first word: not a `Kind`, so a channel pairing with it objects
_SHOWN = _HEADER - 3  # changed ds_ids one rank's header names


class DiscardedChangeError(ZeroParamError):
    """Parameters gathered by ``GatheredParameters`` without ``modifier_rank`` were changed
    inside the block, and the change was dropped: raised on every rank of the group.

    `changed` maps each parameter's name to the ranks (global) that changed it; a rank lists
    five parameters at most. It is a ``RuntimeError`` whose message says "in-place
    modification", as DeepSpeed's.
    """

    def __init__(self, message: str, changed: dict[str, list[int]]) -> None:
        super().__init__(message)
        self.changed = changed


def _name(p: ZeroParameter) -> str:
    """The parameter's name in its model (`partition` names them), else its id, its module's
    type and its shape (`Init` alone knows no names)."""
    name: str | None = getattr(p, "ds_name", None)
    if name:
        return name
    unit = getattr(p, "ds_unit", None)
    owner = f"{unit.name} " if unit is not None else ""
    return f"ds_id {p.ds_id} ({owner}{tuple(p.ds_shape)})"


def _checksum(ids: Sequence[int]) -> int:
    total = 0
    for i in ids:
        total = (total * 1_000_003 + i + 1) % (1 << 61)
    return total


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether the byte ranges `a` and `b` differ (a 0-d bool tensor, not yet read): compared
    as the widest integers both allow, bit for bit (a NaN equals itself), 3x faster than bytes."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        w = dtype.itemsize
        if a.numel() % w == 0 and a.data_ptr() % w == 0 and b.data_ptr() % w == 0:
            return torch.ne(a.view(dtype), b.view(dtype)).any()
    return torch.ne(a, b).any()


@dataclass
class Found:
    """What the ranks agreed was changed: ranks (global) by ``ds_id`` (empty: in another shard
    group only), the names of those parameters, and how many more than a header names, by
    rank (rank -1: more in another shard group)."""

    ranks: dict[int, list[int]] = field(default_factory=dict)
    more: dict[int, int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.ranks or self.more)


@dataclass
class _Seen:
    """What one parameter was at the start of the block."""

    version: int
    ptr: int
    shape: torch.Size
    dtype: torch.dtype


class Snapshot:
    """The gathered parameters of one block as they were at its start (counters and pointers
    only), and the check at its end: [Note: discarded changes]."""

    def __init__(
        self, params: Sequence[ZeroParameter], units: Sequence[Unit], saved: Sequence[torch.Tensor]
    ) -> None:
        self.params = list(params)
        self.units = list(units)
        # one rank: each direct unit's copy of its shard, which the block restores at its end
        self.saved = {id(u.shard): s for u, s in zip(self._direct(), saved, strict=True)}
        self.seen = [_Seen(p._version, p.data_ptr(), p.shape, p.dtype) for p in self.params]
        self.shard_versions = {u.uid: u.shard._version for u in self.units}

    def _direct(self) -> list[Unit]:
        return [u for u in self.units if u.full is u.shard]

    def changed_here(self) -> list[int]:
        """Positions in `params` of the parameters this rank sees changed."""
        differs = self._content_differs()
        # shards written inside the block (a nested block with a modifier, an optimizer
        # step, ``ds_tensor.copy_``): those writes are kept, so their units are not judged
        written = {
            id(q)
            for u in self.units
            if u.shard._version != self.shard_versions[u.uid]
            for q in u.params
        }
        out = []
        for i, (p, seen) in enumerate(zip(self.params, self.seen, strict=True)):
            if p.ds_status is not ZeroParamStatus.AVAILABLE or id(p) in written:
                continue  # released inside the block (``p.partition()``), or written: above
            if (
                p._version != seen.version
                or p.data_ptr() != seen.ptr
                or p.shape != seen.shape
                or p.dtype != seen.dtype
                or differs.get(id(p), False)
            ):
                out.append(i)
        return out

    def _content_differs(self) -> dict[int, bool]:
        """Whether this rank's chunk of each parameter differs from its shard, for the units
        where that can be read cheaply; one synchronization for all of them."""
        flags: dict[int, torch.Tensor] = {}
        wanted = {id(p) for p in self.params}
        for u in self.units:
            if (
                u.status is not ZeroParamStatus.AVAILABLE
                or u.codes is not None
                or u.shard._version != self.shard_versions[u.uid]  # not judged: changed_here
            ):
                continue
            saved = self.saved.get(id(u.shard))
            for j, p in enumerate(u.params):
                if id(p) not in wanted:
                    continue
                if saved is not None:  # one rank: the shard was written through `p.data`
                    off, n = u.offsets[j], u.chunks[j] * p.element_size()
                    flags[id(p)] = _differ(u.shard[off : off + n], saved[off : off + n])
                    continue
                block, off, n = u._copy_plan[j]
                mine = u.shard[off : off + n]
                if block.device != mine.device:
                    continue  # offloaded: comparing would copy the chunk across
                flags[id(p)] = _differ(block[u.channel.rank], mine)
        if not flags:
            return {}
        values = torch.stack(list(flags.values())).tolist()
        return dict(zip(flags, values, strict=True))

    def agree(self, channel: Channel, changed: list[int]) -> Found:
        """Every rank's changed parameters: the same answer on every rank of the group (and
        of its replicas, with hybrid sharding); raise `ZeroParamError` if the ranks did not
        all end this block."""
        ids = [p.ds_id for p in self.params]
        found = Found()
        if channel.size == 1:
            for i in changed:
                found.ranks.setdefault(ids[i], []).append(channel.global_rank)
        else:
            mine = [_MARK, len(changed), _checksum(ids)]
            mine += [ids[i] for i in changed[:_SHOWN]]
            mine += [-1] * (_HEADER - len(mine))
            header = torch.tensor(mine, dtype=torch.int64, device=channel.device)
            everyone = torch.empty(channel.size * _HEADER, dtype=torch.int64, device=channel.device)
            zcomm.all_gather_into_tensor(everyone, header, group=channel.group)
            rows = everyone.view(channel.size, _HEADER).tolist()
            ranks = (
                dist.get_process_group_ranks(channel.group)
                if channel.group is not None
                else list(range(channel.size))
            )
            if any(row[0] != _MARK or row[2] != mine[2] for row in rows):
                raise ZeroParamError(_disagreement(channel.rank, ranks, rows))
            for who, row in zip(ranks, rows, strict=True):
                for pid in row[3 : 3 + min(row[1], _SHOWN)]:
                    found.ranks.setdefault(pid, []).append(who)
                if row[1] > _SHOWN:
                    found.more[who] = row[1] - _SHOWN
        replicate = self.units[0].replicate if self.units else None
        if replicate is not None:  # [Note: hybrid sharding]: the other shard groups learn it
            marks = [int(pid in found.ranks) for pid in ids] + [int(bool(found.more))]
            flags = torch.tensor(marks, dtype=torch.int32, device=channel.device)
            zcomm.all_reduce(flags, op=dist.ReduceOp.MAX, group=replicate)
            for i in flags[:-1].nonzero().flatten().tolist():
                found.ranks.setdefault(ids[i], [])  # []: changed in another shard group only
            if flags[-1] and not found.more:
                found.more[-1] = 0  # more, in another shard group
        found.names = {p.ds_id: _name(p) for p in self.params if p.ds_id in found.ranks}
        return found


def _disagreement(me: int, ranks: list[int], rows: list[list[int]]) -> str:
    lines = [
        "ranks disagree at the end of a GatheredParameters block (every rank of the group "
        "must enter and leave the same blocks in the same order):"
    ]
    for r, (who, row) in enumerate(zip(ranks, rows, strict=True)):
        if row[0] != _MARK:
            what = "is communicating something else (a gather, or a collective of its own)"
        elif row[2] == rows[me][2]:
            what = "left this block"
        else:
            what = "left a block of other parameters"
        lines.append(f"  rank {who}{' (this rank)' if r == me else ''}: {what}")
    return "\n".join(lines)


def discarded_error(found: Found) -> DiscardedChangeError:
    """The error for the changed parameters `found`."""
    parts = []
    for pid, ranks in found.ranks.items():
        who = (
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"
            if ranks
            else "a rank of another shard group"
        )
        parts.append(f"{found.names[pid]!r} on {who}")
    parts += [
        f"{n} more on rank {who}" if who >= 0 else "more on a rank of another shard group"
        for who, n in sorted(found.more.items())
    ]
    changed = {found.names[pid]: sorted(ranks) for pid, ranks in found.ranks.items()}
    return DiscardedChangeError(
        "in-place modification of parameters gathered by GatheredParameters without "
        f"modifier_rank: {'; '.join(parts)}. The change was discarded on every rank (the "
        "shards keep the values they had). Pass modifier_rank=<rank> to keep that rank's "
        "values on every rank, or change a copy (p.detach().clone()).",
        changed,
    )
