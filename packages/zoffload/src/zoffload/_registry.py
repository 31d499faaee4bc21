"""Which handle holds which storage, so a tensor can say where its bytes are."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

from zoffload._storage import storage_key

if TYPE_CHECKING:
    from zoffload._handle import OffloadHandle

__all__ = ["add", "find", "handle_of", "remove"]

_lock = threading.Lock()
# Storage identity -> the handle holding its bytes. Weak, so a handle nobody keeps does not
# pin its entry; the handle itself keeps the storage alive, so the key cannot be reused.
_held: dict[int, weakref.ref[OffloadHandle]] = {}


def add(keys: list[int], handle: OffloadHandle) -> None:
    ref = weakref.ref(handle)
    with _lock:
        for key in keys:
            _held[key] = ref


def remove(keys: list[int], handle: OffloadHandle) -> None:
    with _lock:
        for key in keys:
            ref = _held.get(key)
            if ref is not None and ref() in (handle, None):
                del _held[key]


def find(key: int) -> OffloadHandle | None:
    with _lock:
        ref = _held.get(key)
    return None if ref is None else ref()


def handle_of(tensor: torch.Tensor) -> OffloadHandle | None:
    """The handle holding ``tensor``'s bytes (offloaded or being moved), or ``None``.

    ``None`` means the tensor is resident on ``tensor.device``; otherwise the handle's
    ``device`` says where its bytes are (``cpu``, ``nvme``, or ``none`` when freed).
    """
    return find(storage_key(tensor))
