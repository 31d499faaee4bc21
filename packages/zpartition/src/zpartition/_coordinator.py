"""The coordinator: which units to gather ahead, which to keep, from the order modules ran in.

[Note: traces]
A *pass* runs from one root forward to the next (a forward and, when training, its backward).
The first pass of a kind records the order units were fetched in; from the next pass of that
kind on, the record is the *plan*: while the current module computes, the units due next are
gathered ahead (up to ``prefetch_bucket_size`` elements, never past ``max_live_parameters``),
and a released unit is kept when the plan uses it again within ``max_reuse_distance`` elements.
Traces are kept per kind (training or eval, grad or no grad, and how many root forwards with
grad ran since the last backward), so an eval pass between training steps does not throw the
training trace away, as DeepSpeed's single trace does, and a model run twice before one
backward (siamese losses, a policy on chosen then rejected) keeps two plans, the second
holding the backward of both, where one trace would be dropped at every backward. When modules run
in another order than the plan says, the plan is dropped with one warning and the pass goes on
without prefetching; the next pass records again. Ranks never act on the plan without agreeing
first: every gather is announced through the channel (see [Note: agreement]). With a secondary
partition, a unit holding a secondary shard is gathered from it, within its secondary group,
and a training forward's gathers keep one: [Note: secondary partition] (`_secondary.py`).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from zpartition._channel import Channel, Kind
from zpartition._config import ZeroParamConfig
from zpartition._status import ZeroParamStatus
from zpartition._unit import Unit, issue_gathers

__all__ = ["Coordinator"]

log = logging.getLogger("zpartition")
_NOT_AVAILABLE, _INFLIGHT = ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT


class _Plan:
    """A recorded order of unit fetches, with what the decisions need precomputed."""

    def __init__(self, order: list[int], numel: dict[int, int]) -> None:
        self.order = order
        self.cumulative = [0]  # elements fetched before each position
        self.positions: dict[int, list[int]] = {}
        for pos, uid in enumerate(order):
            self.cumulative.append(self.cumulative[-1] + numel[uid])
            self.positions.setdefault(uid, []).append(pos)

    def next_use(self, uid: int, after: int) -> int | None:
        positions = self.positions.get(uid, ())
        i = bisect.bisect_left(positions, after)
        return positions[i] if i < len(positions) else None


class Coordinator:
    """Gathers, keeps and releases the units of one partitioned model."""

    def __init__(self, config: ZeroParamConfig, channel: Channel, units: Sequence[Unit]) -> None:
        self.config = config
        self.channel = channel
        self.units = {u.uid: u for u in units}
        # With one rank a gather costs nothing to wait for: no trace, no prefetch, no keeping.
        self.prefetching = channel.size > 1
        self._traces: dict[object, _Plan] = {}  # complete traces by kind of pass
        self._kind: object = None  # the kind of the pass running now
        self._recording: list[int] | None = None  # fetch order of this pass, while recording
        self._plan: _Plan | None = None  # what this pass follows, when a trace exists
        self._cursor = 0  # the plan position of the next fetch
        self._scanned = 0  # plan positions up to here were considered for prefetching
        self._ahead: dict[int, int] = {}  # units gathered for a later position: uid -> numel
        self._warned = False
        self._keep_direct = config.max_reuse_distance > 0
        self.invalidations = 0  # how many times a plan was dropped (a metric, not an error)
        # between a backward's first hook and its end (the hooks set it): gathers keep no
        # secondary shard then, and a unit's fetch ends the one it holds
        self.in_backward = False

    # -- passes ----------------------------------------------------------------------------

    def begin_pass(self, kind: object) -> None:
        """Close the pass that ran (its record becomes a trace) and start one of `kind`."""
        if self._recording is not None and self._recording:
            numel = {uid: self.units[uid].numel for uid in self._recording}
            self._traces[self._kind] = _Plan(self._recording, numel)
        self.release_all()
        self._kind = kind
        if self.prefetching:
            self._plan = self._traces.get(kind)
            self._recording = [] if self._plan is None else None
        self._cursor = self._scanned = 0

    def release_all(self) -> None:
        """Release every unit not persistent, whoever holds it (the pass is over)."""
        self._ahead.clear()
        for unit in self.units.values():
            if unit.status is not _NOT_AVAILABLE and not unit.persistent:
                unit.users.clear()
                unit.release()

    def drop_secondaries(self) -> None:
        """Drop every unit's secondary shard ([Note: secondary partition])."""
        for unit in self.units.values():
            unit.drop_secondary()

    def forget_recording(self) -> None:
        """The pass being recorded changed what modules fetch (an external parameter was
        found): its order will not repeat, so record the next pass instead."""
        if self._recording is not None:
            self._recording = None

    # -- fetch and release -----------------------------------------------------------------

    def fetch(self, units: Sequence[Unit], user: int) -> None:
        """Make `units` available for `user` (a module id); prefetch what the plan says next."""
        if self._plan is not None:
            self._follow(units)
        elif self._recording is not None:
            self._recording.extend(u.uid for u in units)
        missing = [u for u in units if u.status is _NOT_AVAILABLE]
        if missing:
            self._make_room(sum(u.numel for u in missing), units)
            self._gather(missing)
        for u in units:
            if u.status is _INFLIGHT:
                u.wait()
            u.users.add(user)
            if self.in_backward:
                u.drop_secondary()  # its backward gathered it (or it was kept since its forward)
        if self._plan is not None and self.prefetching:
            self._prefetch(self._plan)

    def prefetch(self) -> None:
        """Gather ahead what the plan says is due next, without fetching anything now (a pass
        begun by a root with no parameters of its own: DeepSpeed prefetches there too)."""
        if self._plan is not None and self.prefetching:
            self._prefetch(self._plan)

    def release(self, units: Sequence[Unit], user: int) -> None:
        """`user` is done with `units`; release each that nobody holds and the plan won't keep."""
        for u in units:
            u.users.discard(user)
            if not u.users and not u.persistent and not self._keep(u):
                u.release()

    def _make_room(self, numel: int, needed: Sequence[Unit]) -> None:
        """Release units kept or prefetched for later until `numel` more fit the live limit
        (the units a module needs now are gathered whatever the limit says)."""
        limit = self.config.max_live_parameters
        if self.channel.live_numel + numel <= limit:
            return  # the common case: room enough, nothing to look through
        for uid in reversed(list(self._ahead)):
            if self.channel.live_numel + numel <= limit:
                return
            unit = self.units[uid]
            if not unit.users and unit not in needed:
                del self._ahead[uid]
                unit.release()

    def _gather(self, units: list[Unit]) -> None:
        """Gather `units` for a pass (comm_dtype's narrower dtypes may go, and with
        ``quantized_weights`` int8 codes: [Note: quantized weights]): those holding a
        secondary shard within their secondary group (exactly: it holds what the forward
        gathered), the others from the primary shards, keeping a secondary shard in a
        training forward. Each part is agreed on its own group's channel ([Note: secondary
        partition])."""
        secondary = [u for u in units if u.holds_secondary()]
        primary = [u for u in units if u.secondary is None] if secondary else units
        if primary:
            self.channel.agree(Kind.GATHER, [u.uid for u in primary])
            keep = not self.in_backward and torch.is_grad_enabled()
            config = self.config
            quantize = config.quantized_weights_block_size if config.quantized_weights else None
            issue_gathers(primary, narrow=True, keep=keep, quantize=quantize)
        if secondary:
            hpz = secondary[0].hpz
            assert hpz is not None
            hpz.agree(Kind.GATHER, [u.uid for u in secondary])
            issue_gathers(secondary, narrow=True, secondary=True)

    # -- following the plan ----------------------------------------------------------------

    def _follow(self, units: Sequence[Unit]) -> None:
        plan = self._plan
        assert plan is not None
        for u in units:
            if self._cursor < len(plan.order) and plan.order[self._cursor] == u.uid:
                self._cursor += 1
                self._ahead.pop(u.uid, None)
            else:
                self._drop_plan(u)
                return

    def _drop_plan(self, unit: Unit) -> None:
        plan = self._plan
        assert plan is not None
        expected = plan.order[self._cursor] if self._cursor < len(plan.order) else None
        self.invalidations += 1
        if not self._warned:
            self._warned = True
            want = "the end of the recorded order" if expected is None else f"unit {expected}"
            log.warning(
                "zpartition: modules ran in a new order (%s where the trace has %s); "
                "prefetching is off until the new order is recorded (warned once)",
                unit.name,
                want,
            )
        self._plan = None
        self._recording = None  # this pass is neither plan nor a clean record
        for uid in list(self._ahead):
            ahead = self.units[uid]
            if not ahead.users and not ahead.persistent:
                ahead.release()
        self._ahead.clear()

    def _keep(self, unit: Unit) -> bool:
        if unit.direct:
            # One rank: no trace; a unit shown in a forward with grad stays (if reuse and the
            # live limit allow) until its backward is done, saving a release and a show. Not one
            # whose shard waits in a store (NVMe): keeping it would keep the model in memory
            # within DeepSpeed's default live limit (1e9 elements), which the store is there
            # to avoid; its store reads it ahead instead.
            keep = (
                self._keep_direct
                and unit.store is None
                and torch.is_grad_enabled()
                and self.channel.live_numel <= self.config.max_live_parameters
            )
            if keep:
                self._ahead[unit.uid] = unit.numel  # evictable by _make_room
            return keep
        plan = self._plan
        if plan is None:
            return False
        nxt = plan.next_use(unit.uid, self._cursor)
        if nxt is None:
            return False
        distance = plan.cumulative[nxt] - plan.cumulative[self._cursor]
        config = self.config
        keep = nxt < self._scanned or (
            distance < config.max_reuse_distance  # DeepSpeed's: 0 keeps nothing
            and self.channel.live_numel <= config.max_live_parameters
        )
        if keep:
            self._ahead[unit.uid] = unit.numel
        return keep

    def _prefetch(self, plan: _Plan) -> None:
        config = self.config
        if config.prefetch_bucket_size == 0:
            return  # no prefetching: nothing is scanned, so nothing is kept for being near
        ahead = sum(self._ahead.values())
        if ahead * 2 > config.prefetch_bucket_size:
            return  # enough in flight: refill in large batches, one agreement each
        pos = max(self._scanned, self._cursor)
        live = self.channel.live_numel
        batch: list[Unit] = []
        while pos < len(plan.order):
            unit = self.units[plan.order[pos]]
            if unit.status is _NOT_AVAILABLE and unit not in batch:
                grown = ahead + unit.numel
                if grown > config.prefetch_bucket_size or (
                    live + unit.numel > config.max_live_parameters
                ):
                    break
                batch.append(unit)
                ahead, live = grown, live + unit.numel
                self._ahead[unit.uid] = unit.numel
            pos += 1
        self._scanned = pos
        if batch:
            self._gather(batch)
