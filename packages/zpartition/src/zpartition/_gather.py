"""Gathering outside the hooks: one channel per process group, the registry of units by id, and
the explicit gather and release behind ``param.all_gather()``, ``param.partition()`` and
`GatheredParameters`."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from zpartition._channel import Channel, Kind
from zpartition._errors import ZeroParamError
from zpartition._param import ZeroParameter
from zpartition._shard import check_bound
from zpartition._status import ZeroParamStatus
from zpartition._unit import Unit, issue_gathers

__all__ = [
    "EXPLICIT",
    "bind_gather_methods",
    "channel_for",
    "gather_now",
    "new_unit",
    "release_now",
]

# The user id of gathers asked for explicitly (all_gather(), GatheredParameters): such a unit
# stays gathered until the matching release, whatever the hooks do meanwhile.
EXPLICIT = -1

# The channel of each process group (the world's under its group object), for exactly as long as
# the group lives: the keys are weak, so an entry goes when its group does (torch holds a group
# until destroy_process_group; a new world is a new object) and never before, since a group's
# ds_id and unit-id counters must go on counting, the same on every rank, while it is in use.
_channels: weakref.WeakKeyDictionary[dist.ProcessGroup, Channel] = weakref.WeakKeyDictionary()


def channel_for(group: dist.ProcessGroup | None) -> Channel:
    """The channel of `group`, made on first use (every rank of the group gets the same one)."""
    if group is not None and dist.get_rank(group) < 0:  # new_group's handle for ranks outside
        raise ZeroParamError("this rank is not in the process group to partition across")
    key = group if group is not None else dist.group.WORLD
    if key is None:
        raise ZeroParamError("torch.distributed is not started (zcomm.init_distributed())")
    channel = _channels.get(key)
    if channel is None:
        channel = _channels[key] = Channel(group)
    return channel


def new_unit(
    uid: int,
    name: str,
    params: Sequence[ZeroParameter],
    channel: Channel,
    device: torch.device,
    replicate: dist.ProcessGroup | None = None,
) -> Unit:
    unit = Unit(uid, name, params, channel, device=device)
    unit.replicate = replicate
    channel.units[uid] = unit
    return unit


def _units_of(params: Iterable[ZeroParameter]) -> list[Unit]:
    found: dict[int, Unit] = {}
    for p in params:
        unit = getattr(p, "ds_unit", None)
        if unit is None:
            raise TypeError(
                f"parameter of shape {tuple(p.shape)} is not a ZeRO-3 parameter "
                "(partition its module with zpartition.Init or zpartition.partition first)"
            )
        found.setdefault(unit.uid, unit)
    return [found[k] for k in sorted(found)]  # the same order on every rank


def gather_now(params: Iterable[ZeroParameter], user: int = EXPLICIT) -> list[Unit]:
    """Gather the units holding `params` (all of them: a unit moves whole) and keep them."""
    units = _units_of(params)
    for u in units:
        check_bound(u.bound)  # a rebound `ds_tensor` would be ignored: [Note: shard writes]
        if u.persistent:
            u.refresh()
        u.make_exact()  # a pass gathered it narrow: read here, it must be as it is
    missing = [u for u in units if u.status is ZeroParamStatus.NOT_AVAILABLE]
    by_channel: dict[int, list[Unit]] = {}
    for u in missing:
        by_channel.setdefault(id(u.channel), []).append(u)
    for batch in by_channel.values():
        batch[0].channel.agree(Kind.GATHER, [u.uid for u in batch])
        issue_gathers(batch)
    for u in units:
        u.wait()
        u.users.add(user)
    return units


def release_now(
    params: Iterable[ZeroParameter], user: int = EXPLICIT, *, give_away: bool = False
) -> None:
    """Drop `user`'s hold on the units of `params`; release those nobody else holds
    (`give_away`: see `Unit.release`)."""
    for u in _units_of(params):
        u.users.discard(user)
        if not u.users and not u.persistent:
            u.release(give_away=give_away)


def bind_gather_methods(param: ZeroParameter) -> None:
    """Give `param` DeepSpeed's ``all_gather()`` and ``partition()``, bound like methods: here
    and not in `zpartition._param`, because gathering needs units and units import `_param`."""
    param.__dict__.update(
        all_gather=functools.partial(_all_gather, param),
        partition=functools.partial(_partition, param),
    )


def _all_gather(param: ZeroParameter, param_list: list[ZeroParameter] | None = None) -> None:
    gather_now(param_list if param_list is not None else [param])


def _partition(param: ZeroParameter, param_list: list[ZeroParameter] | None = None) -> None:
    # what was taken from the gathered parameter stays valid, as with GatheredParameters
    release_now(param_list if param_list is not None else [param], give_away=True)
