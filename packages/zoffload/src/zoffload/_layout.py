"""Where each storage's bytes go in a handle's host region or NVMe file.

[Note: packing]
A transfer has a fixed cost (a launch, a DMA set-up, a syscall) that dominates for small
storages, and an optimizer state is mostly small tensors. So storages below ``small_bytes``
on one device are laid end to end (64-byte aligned) in segments of up to ``pack_bytes``: a GPU
moves each segment with one gather on the device and one copy over the link (on the host,
packing only saves the page of padding each storage would otherwise take). Bytes are
moved raw, so dtypes do not matter and need no grouping. Large storages each get a segment
of their own starting on an ``alignment`` boundary (4096: pages, O_DIRECT blocks), or just
after one for host storages (see [Note: direct placement]).

[Note: direct placement]
O_DIRECT moves bytes between a file and memory without a copy only where the memory address
and the file offset are both block-aligned, and torch's host allocations are aligned to 64
bytes, not to pages (a large one typically starts 64 bytes into a page). So a large host
storage is placed ``address % alignment`` bytes after a boundary: its page-aligned interior
then lies on the file's blocks, and the NVMe I/O reads and writes it in place, with only its
unaligned head and tail going through a staging buffer (see [Note: extents] in ``_extents``).
The address is the one at offload; the storage's memory at reload is a new allocation. glibc
maps every block of 32 MiB or more afresh, at the same offset in its page each time; smaller
ones may come from its heap once a larger block was freed, anywhere. A storage whose new
address does not line up goes through staging: slower, never wrong (and drives that need
only a few bytes of alignment, as NVMe drives usually report, line up whatever the address).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zoffload._storage import Slot

__all__ = ["Layout", "Segment", "align_up", "plan"]

_SMALL_ALIGN = 64  # a cache line; keeps vectorised gathers aligned


@dataclass(eq=False)
class Segment:
    """A byte range of the layout moved as one transfer."""

    device: torch.device
    offset: int
    nbytes: int
    packed: bool  # several small storages, gathered on the device first
    slots: list[Slot] = field(default_factory=list)


@dataclass(eq=False)
class Layout:
    """Offsets for every slot (set on the slots) and the segments that cover them."""

    nbytes: int
    segments: list[Segment]


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan(
    slots: list[Slot],
    *,
    small_bytes: int = 1 << 20,
    pack_bytes: int = 64 << 20,
    alignment: int = 4096,
) -> Layout:
    """Assign ``slot.offset`` for every slot with bytes and group them into segments."""
    segments: list[Segment] = []
    end = 0
    for device in dict.fromkeys(s.device for s in slots):
        mine = [s for s in slots if s.device == device and s.nbytes > 0]
        small = [s for s in mine if s.nbytes < small_bytes]
        current: Segment | None = None
        for slot in small:
            if current is None or current.nbytes + slot.nbytes > pack_bytes:
                current = Segment(device, align_up(end, alignment), 0, packed=True)
                segments.append(current)
            slot.offset = current.offset + align_up(current.nbytes, _SMALL_ALIGN)
            current.nbytes = slot.offset + slot.nbytes - current.offset
            current.slots.append(slot)
            end = current.offset + current.nbytes
        for slot in mine:
            if slot.nbytes < small_bytes:
                continue
            slot.offset = align_up(end, alignment) + _in_block(slot, alignment)
            segments.append(Segment(device, slot.offset, slot.nbytes, packed=False, slots=[slot]))
            end = slot.offset + slot.nbytes
    return Layout(align_up(end, alignment), segments)


def _in_block(slot: Slot, alignment: int) -> int:
    """Where a large storage starts after a boundary: see [Note: direct placement]."""
    if slot.device.type != "cpu":
        return 0  # a GPU's bytes always go through a (pinned) staging buffer
    return slot.storage.data_ptr() % alignment
