"""Point-to-point: send, recv, their async forms and a batch of them.

Peers are global ranks, as in torch.distributed. Sending to oneself is refused with a clear
error rather than left to deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zcomm._checks import check_group, check_peer, check_tensor
from zcomm._errors import comm_error
from zcomm._handle import Handle, run
from zcomm._world import group_size

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _checked(op: str, tensor: Any, name: str, peer: Any, group: Any) -> tuple[torch.Tensor, int]:
    check_tensor(op, "tensor", tensor)
    group_size(op, check_group(op, group))
    return tensor, check_peer(op, name, peer, group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def isend(
    tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0
) -> Handle:
    """Start sending `tensor` to global rank `dst`; wait on the handle before reusing it."""
    tensor, dst = _checked("isend", tensor, "dst", dst, group)
    return run(
        "send",
        group,
        lambda _: dist.isend(tensor, dst, group=group, tag=tag),
        async_op=True,
        nbytes=_nbytes(tensor),
        peer=dst,
    )


def irecv(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0
) -> Handle:
    """Start receiving into `tensor` from global rank `src`; read it after waiting."""
    tensor, src = _checked("irecv", tensor, "src", src, group)
    return run(
        "recv",
        group,
        lambda _: dist.irecv(tensor, src, group=group, tag=tag),
        async_op=True,
        nbytes=_nbytes(tensor),
        peer=src,
    )


def send(
    tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0
) -> None:
    """Send `tensor` to global rank `dst` and wait until it has gone."""
    isend(tensor, dst, group=group, tag=tag).wait()


def recv(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0
) -> int:
    """Receive into `tensor` from global rank `src`; returns `src`."""
    irecv(tensor, src, group=group, tag=tag).wait()
    return src


@dataclass(frozen=True)
class P2POp:
    """One send or receive of a batch: ``P2POp(zcomm.isend, tensor, peer)`` (torch's form)."""

    op: Callable[..., Any]
    tensor: torch.Tensor
    peer: int
    group: dist.ProcessGroup | None = None
    tag: int = 0


_SENDS = (isend, dist.isend)
_RECVS = (irecv, dist.irecv)


def _to_torch(i: int, p2p: Any) -> tuple[dist.P2POp, str]:
    where = f"batch_isend_irecv(ops[{i}])"
    if isinstance(p2p, dist.P2POp):
        p2p = P2POp(p2p.op, p2p.tensor, p2p.peer, p2p.group, p2p.tag)
    if not isinstance(p2p, P2POp):
        raise TypeError(f"{where}: expected a zcomm.P2POp, got {type(p2p).__name__}")
    if p2p.op not in _SENDS + _RECVS:
        raise ValueError(f"{where}: op must be zcomm.isend or zcomm.irecv, got {p2p.op!r}")
    is_send = p2p.op in _SENDS
    _checked(where, p2p.tensor, "dst" if is_send else "src", p2p.peer, p2p.group)
    torch_op = dist.isend if is_send else dist.irecv
    return dist.P2POp(
        torch_op, p2p.tensor, p2p.peer, p2p.group, p2p.tag
    ), "send" if is_send else "recv"


def batch_isend_irecv(ops: Sequence[P2POp | dist.P2POp]) -> list[Handle]:
    """Start a batch of sends and receives together (one coalesced launch on NCCL).

    Returns one handle per op, in order. Batching lets a rank post its send and its receive
    at once, so two neighbours exchanging data cannot deadlock on ordering.
    """
    given: object = ops  # checked at run time, whatever the annotation says
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise TypeError(
            f"batch_isend_irecv(ops=...): expected a list of P2POp, got {type(ops).__name__}"
        )
    if not ops:
        raise ValueError("batch_isend_irecv(ops=...): the list is empty")
    converted = [_to_torch(i, p) for i, p in enumerate(ops)]
    group = converted[0][0].group
    try:
        works = dist.batch_isend_irecv([c for c, _ in converted])
    except RuntimeError as error:
        raise comm_error("batch_isend_irecv", group, error) from error
    handles = []
    for (c, kind), work in zip(converted, works, strict=True):
        handle = Handle(kind, c.group, work, nbytes=_nbytes(c.tensor), peer=c.peer)
        handles.append(handle)
    return handles
