"""`GatheredParameters`: full parameters inside a ``with`` block, as DeepSpeed's."""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

import zcomm
from zpartition._channel import Kind
from zpartition._discarded import Found, Snapshot, discarded_error
from zpartition._errors import ZeroParamError
from zpartition._external import register_external_parameter
from zpartition._gather import gather_now, release_now
from zpartition._param import ZeroParameter, next_module_id, zero_params

__all__ = ["GatheredParameters"]


def _zero_params(params: torch.Tensor | Iterable[torch.Tensor] | None) -> list[ZeroParameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        params = [params]
    unique = {p.ds_id: p for p in zero_params(params) if hasattr(p, "ds_id")}
    return [unique[k] for k in sorted(unique)]  # one order on every rank


class GatheredParameters:
    """Gather `params` on entry; on exit, keep `modifier_rank`'s changes or refuse changes.

    With ``modifier_rank=r``, rank r's values (changed inside the block, on every rank's copy
    or only on r's) are broadcast to every rank and cut into the shards again; with ``None``,
    the block is a read: the shards stay as they were, and a change made inside (on any rank)
    is dropped and raises `DiscardedChangeError` on every rank of the group, naming the
    parameters and the ranks ([Note: discarded changes], which says what is seen and what is
    not). Parameters that are not partitioned are passed over; ``enabled=False`` does nothing.
    `fwd_module` registers the parameters as external parameters of that module. Every rank
    of the group must enter and leave the block.
    """

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor] | None,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        self.params = _zero_params(params) if enabled else []
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self._user = next_module_id()  # holds the units for this block only
        # With one rank the full data *is* the shard, so edits must be undone by hand.
        # (A write to the shard itself, a nested block's with a modifier, is kept.)
        self._saved: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._snapshot: Snapshot | None = None  # without modifier_rank: what to check at exit

    def __enter__(self) -> None:
        if not self.params:
            return
        units = gather_now(self.params, self._user)
        if self.modifier_rank is None:
            self._saved = [
                (u.shard, u.shard.clone(), u.shard._version) for u in units if u.full is u.shard
            ]
            self._snapshot = Snapshot(self.params, units, [s for _, s, _ in self._saved])
        if self.fwd_module is not None:
            for p in self.params:
                register_external_parameter(self.fwd_module, p)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        if not self.params:
            return
        snapshot, self._snapshot = self._snapshot, None
        found = Found()
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._keep_changes(self.modifier_rank)
            # after a disagreement the ranks' collectives no longer pair: agree on nothing more
            if snapshot is not None and not (exc_type and issubclass(exc_type, ZeroParamError)):
                found = self._check(snapshot, quiet=exc_type is not None)
        finally:
            for shard, saved, version in self._saved:
                if shard._version == version:
                    shard.copy_(saved)
            self._saved = []
            if found:  # persistent units stay gathered: the next refresh gathers them again
                for u in snapshot.units if snapshot is not None else []:
                    if u.persistent:
                        u._gathered_version = -1  # every rank alike: all found the same
            # what the block took from the parameters (a state_dict) stays valid after it
            release_now(self.params, self._user, give_away=True)
        if found and exc_type is None:
            raise discarded_error(found)

    @staticmethod
    def _check(snapshot: Snapshot, *, quiet: bool) -> Found:
        """What every rank changed ([Note: discarded changes]). `quiet`: the block is raising
        already; agree all the same (the other ranks wait for it) but let that exception go."""
        channel = snapshot.units[0].channel
        try:
            return snapshot.agree(channel, snapshot.changed_here())
        except Exception:
            if not quiet:
                raise
            return Found()

    def _keep_changes(self, modifier_rank: int) -> None:
        """Broadcast the modifier's full values and write this rank's chunk into the shard."""
        unit = self.params[0].ds_unit
        assert unit is not None  # partitioned parameters always have one
        channel = unit.channel
        channel.agree(Kind.BROADCAST, [p.ds_id for p in self.params])
        src = (
            dist.get_global_rank(channel.group, modifier_rank)
            if channel.group is not None
            else modifier_rank
        )
        replicate = unit.replicate  # replica 0's modifier's values: [Note: hybrid sharding]
        first = dist.get_global_rank(replicate, 0) if replicate is not None else -1
        units = {id(p.ds_unit): p.ds_unit for p in self.params if p.ds_unit is not None}
        for u in units.values():
            u.bring_in()  # kept as codes ([Note: quantized frozen weights]): put away at release
        for p in self.params:
            full = p.data.reshape(-1)
            zcomm.broadcast(full, src, group=channel.group)
            if replicate is not None:
                zcomm.broadcast(full, first, group=replicate)
            chunk = p.ds_tensor.numel()
            start = min(channel.rank * chunk, full.numel())
            stop = min(start + chunk, full.numel())
            p.ds_tensor[: stop - start].copy_(full[start:stop])
