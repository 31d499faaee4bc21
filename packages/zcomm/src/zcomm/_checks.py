"""Argument checks shared by the operations: a bad argument is an error that names it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["check_group", "check_peer", "check_rank", "check_same_kind", "check_tensor"]


def check_tensor(op: str, name: str, value: Any) -> torch.Tensor:
    """`value` as a tensor, or a TypeError naming `op` and the argument `name`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}({name}=...): expected a torch.Tensor, got {type(value).__name__}")
    return value


def check_same_kind(
    op: str, name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor
) -> None:
    """Dtype and device of `tensor` must match those of `ref`."""
    if tensor.dtype != ref.dtype:
        raise TypeError(f"{op}: {name} has dtype {tensor.dtype}, but {ref_name} has {ref.dtype}")
    if tensor.device != ref.device:
        raise ValueError(f"{op}: {name} is on {tensor.device}, but {ref_name} is on {ref.device}")


def check_group(op: str, group: Any) -> dist.ProcessGroup | None:
    """`group` as a process group (None means the world), or an error naming the problem."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        # torch warns and does nothing here; a rank calling into a group it is not in is
        # taken for a mistake (a guard on the rank missing), not skipped in silence
        raise ValueError(
            f"{op}(group=...): rank {dist.get_rank()} is not in this group (new_group gave "
            "the ranks outside it torch's NON_GROUP_MEMBER placeholder); call it on the "
            "group's ranks only"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{op}(group=...): expected a ProcessGroup or None, got {type(group).__name__}"
        )
    return group


def check_rank(op: str, name: str, rank: Any, group: dist.ProcessGroup | None) -> int:
    """`rank` as a global rank of `group`, or an error naming `name`."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{op}({name}=...): expected a rank (int), got {rank!r}")
    ranks = range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
    if rank not in ranks:
        raise ValueError(f"{op}({name}={rank}): not a rank of the group (ranks {list(ranks)})")
    return rank


def check_peer(op: str, name: str, peer: Any, group: dist.ProcessGroup | None) -> int:
    """`peer` as a global rank of `group` other than this one, or an error naming `name`."""
    rank = check_rank(op, name, peer, group)
    if rank == dist.get_rank():
        raise ValueError(f"{op}({name}={rank}): that is this process's own rank")
    return rank
