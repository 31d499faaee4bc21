"""`GatheredParameters`: full parameters inside a ``with`` block, as DeepSpeed's."""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

import zcomm
from zpartition._channel import Kind
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
    """Gather `params` on entry; on exit, keep `modifier_rank`'s changes or drop all changes.

    With ``modifier_rank=r``, rank r's values (changed inside the block, on every rank's copy
    or only on r's) are broadcast to every rank and cut into the shards again; with ``None``,
    changes are dropped and the shards stay as they were. Parameters that are not partitioned
    are passed over; ``enabled=False`` does nothing. `fwd_module` registers the parameters as
    external parameters of that module. Every rank of the group must enter the block.
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
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        if not self.params:
            return
        units = gather_now(self.params, self._user)
        if self.modifier_rank is None:
            self._saved = [(u.shard, u.shard.clone()) for u in units if u.full is u.shard]
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
        if self.modifier_rank is not None and exc_type is None:
            self._keep_changes(self.modifier_rank)
        for shard, saved in self._saved:
            shard.copy_(saved)
        self._saved = []
        # what the block took from the parameters (a state_dict) stays valid after it
        release_now(self.params, self._user, give_away=True)

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
