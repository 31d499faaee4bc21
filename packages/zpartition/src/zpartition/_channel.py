"""Every collective zpartition issues goes through a `Channel`, which makes ranks agree first.

[Note: agreement]
ZeRO-3 is only correct while every rank gathers the same parameters in the same order. When
ranks disagree (one skips a branch), a plain collective of mismatched sizes aborts gloo's
process with no message and hangs NCCL. So each batch of collectives is preceded by a fixed-size
*header* all-gather that says what this rank is about to send: a kind and the unit ids. Headers
are all the same size, so two ranks that disagree still pair header with header; the payload
goes out only once every header matched, and a mismatch raises `ZeroParamError` on every rank,
naming what each rank wanted (module, parameters, rank). One tiny collective per batch is the
price; batches are large once the coordinator prefetches.

The header also carries the engine call and step each rank is in (`zcomm.set_activity`, two
words read here, set once per engine call), so ranks out of step (one in ``step()`` while the
other gathers for a forward) fail together with each rank's call and step named, rather than
pair a gather with a reduction and hang.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import zcomm
from zpartition._errors import ZeroParamError

__all__ = ["Channel", "Kind"]

_HEADER = 10  # int64 words: kind, count, checksum, engine call, step, then up to five ids
_IDS = 5  # where the ids start
_SHOWN = _HEADER - _IDS


class Kind(enum.IntEnum):
    """What a batch of collectives does."""

    GATHER = 1
    REDUCE = 2
    BROADCAST = 3
    END_BACKWARD = 4
    STEP = 5  # an engine's optimizer step begins


def _checksum(ids: Sequence[int]) -> int:
    total = 0
    for i in ids:
        total = (total * 1_000_003 + i + 1) % (1 << 61)
    return total


class Channel:
    """The process group of one partitioned model, with agreement before each batch."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        # Weakly: `zpartition._gather` keeps a channel for as long as its group lives, keyed
        # weakly by the group, which a strong reference from here would keep alive for good.
        self._group = None if group is None else weakref.ref(group)
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        self.units: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        backend = str(dist.get_backend(group))
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in backend
            else torch.device("cpu")
        )
        # ids of units and parameters made on this group: the same on every rank, because every
        # rank builds the same modules in the same order (headers and orders rely on that)
        self._unit_ids = itertools.count()
        self._param_ids = itertools.count()
        self.live_numel = 0  # elements of non-persistent parameters gathered or in flight now
        self.peak_live_numel = 0  # the most there ever were; `reset_peak` starts over

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None: the world)."""
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise ZeroParamError(
                "the process group these parameters are partitioned across was destroyed"
            )
        return group

    def next_unit_id(self) -> int:
        return next(self._unit_ids)

    def next_param_id(self) -> int:
        return next(self._param_ids)

    def count_live(self, delta: int) -> None:
        self.live_numel += delta
        if self.live_numel > self.peak_live_numel:
            self.peak_live_numel = self.live_numel

    def describe(self, uid: int) -> str:
        """Unit `uid` in words, for messages: its module's name and its parameters' names."""
        unit = self.units.get(uid)
        if unit is None:
            return f"unit {uid}"
        names = [getattr(p, "ds_name", f"ds_id {p.ds_id}") for p in unit.params]
        shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
        return f"module {unit.name!r} (parameters {shown})"

    def agree(self, kind: Kind, ids: Sequence[int]) -> None:
        """Block until every rank announced the same `kind` and `ids`; raise if one did not."""
        if self.size == 1:
            return
        activity = zcomm.current_activity
        mine = [int(kind), len(ids), _checksum(ids), activity.code, activity.step, *ids[:_SHOWN]]
        mine += [-1] * (_HEADER - len(mine))
        header = torch.tensor(mine, dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.size * _HEADER, dtype=torch.int64, device=self.device)
        zcomm.all_gather_into_tensor(everyone, header, group=self.group)
        rows = everyone.view(self.size, _HEADER).tolist()
        if any(row[:_IDS] != mine[:_IDS] for row in rows):
            raise ZeroParamError(self._disagreement(rows))

    def _disagreement(self, rows: list[list[int]]) -> str:
        ours = all(row[0] in set(Kind) for row in rows)  # else a header of another layout
        if ours and any(row[3:_IDS] != rows[0][3:_IDS] for row in rows):
            lines = [
                "ranks are out of step: they are in different engine calls or steps (every rank "
                "must make the same engine calls, forward, backward, step, in the same order):"
            ]
        else:
            lines = [
                "ranks disagree on which parameters to communicate (every rank must run the "
                "same modules in the same order; make a module that runs on some ranks only a "
                "leaf with zpartition.set_z3_leaf_modules so its parent gathers it on every "
                "rank):"
            ]
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else None
        for r, row in enumerate(rows):
            who = ranks[r] if ranks is not None else r
            kind = Kind(row[0]).name.lower().replace("_", " ") if row[0] in set(Kind) else "?"
            shown = [self.describe(i) for i in row[_IDS : _IDS + min(row[1], _SHOWN)]]
            more = f" and {row[1] - _SHOWN} more" if row[1] > _SHOWN else ""
            bare = row[0] in (Kind.STEP, Kind.END_BACKWARD)  # kinds that name no units
            what = "; ".join(shown) + more if shown else "" if bare else "nothing"
            if row[1] > 1:
                what = f"{row[1]} units: {what}"
            mark = " (this rank)" if r == self.rank else ""
            if row[0] in set(Kind) and 0 <= row[3] < len(zcomm.CALLS):
                where = f"in {zcomm.CALLS[row[3]]}, step {row[4]}: "
            else:
                where = ""  # not a channel's header: it carries no call or step
            lines.append(f"  rank {who}{mark}: {where}{kind} {what}".rstrip())
        return "\n".join(lines)
