"""Planning a file's chunks ([Note: extents]): every byte once, in order, in place only where
O_DIRECT can move it, and zero runs found as `_pages.zero_runs` finds them."""

from __future__ import annotations

import ctypes

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoffload._extents import BLOCK, Alignment, find_zero_runs, plan_chunks
from zoffload._pages import ZERO_BLOCK, zero_runs
from zoffload._storage import Slot, byte_view


def _slot(t: torch.Tensor) -> Slot:
    s = t.untyped_storage()
    return Slot(s, s.nbytes(), t.device, ["t"], [t])


def _address(memory: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(memory))


@settings(max_examples=40, deadline=None)
@given(
    nblocks=st.integers(0, 150),
    tail=st.integers(1, 100),
    marks=st.lists(st.integers(0, 150 * ZERO_BLOCK), max_size=12),
    shift=st.sampled_from([0, 3, 8]),
)
def test_find_zero_runs_is_zero_runs(nblocks, tail, marks, shift):
    raw = bytearray(nblocks * ZERO_BLOCK + tail + shift)
    for m in marks:
        if shift + m < len(raw):
            raw[shift + m] = 1 + m % 255
    # an unaligned start (shift 3) is looked at whole; frombuffer's storage starts there
    slot = _slot(torch.frombuffer(raw, dtype=torch.uint8, offset=shift))
    assert find_zero_runs(slot) == zero_runs(byte_view(slot.storage))


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5 * ZERO_BLOCK), min_size=1, max_size=6),
    gaps=st.lists(st.integers(0, 3), min_size=6, max_size=6),
    placed=st.lists(st.booleans(), min_size=6, max_size=6),
    zero_every=st.integers(1, 4),
    chunk_blocks=st.integers(1, 40),
    align=st.sampled_from(
        [None, Alignment(1, 1), Alignment(4, 512), Alignment(512, 512), Alignment()]
    ),
)
def test_chunk_extents_cover_the_data_in_order(
    sizes, gaps, placed, zero_every, chunk_blocks, align
):
    slots, end = [], 0
    for i, size in enumerate(sizes):
        slot = _slot(torch.empty(size, dtype=torch.uint8))
        # as _layout places a large host storage, or not (then nothing is in place)
        in_block = slot.storage.data_ptr() % BLOCK if placed[i] else 0
        slot.offset = end + gaps[i] * BLOCK + in_block
        blocks = size // ZERO_BLOCK
        runs = [(k * ZERO_BLOCK, (k + 1) * ZERO_BLOCK) for k in range(1, blocks, zero_every)]
        slot.zeros = runs if zero_every > 1 else runs[:1]  # runs apart from each other
        slots.append(slot)
        end = slot.offset + size
    nbytes = -(-end // BLOCK) * BLOCK
    chunk_bytes = chunk_blocks * BLOCK
    chunks = plan_chunks(slots, nbytes, chunk_bytes, align)
    assert [c.start for c in chunks] == list(range(0, nbytes, chunk_bytes))
    for chunk in chunks:
        cursor = chunk.start
        for e in chunk.extents:
            assert e.start == cursor < e.stop <= chunk.stop
            cursor = e.stop
            if e.slot is None:
                assert e.memory is None
                continue
            rel = (e.start - e.slot.offset, e.stop - e.slot.offset)
            assert 0 <= rel[0] < rel[1] <= e.slot.nbytes
            assert all(rel[1] <= a or b <= rel[0] for a, b in e.slot.zeros)
            if e.memory is not None:  # O_DIRECT's rules, and the storage's own bytes
                assert align is not None
                assert e.start % align.offset == 0
                assert e.stop % align.offset == 0
                assert len(e.memory) == e.stop - e.start
                assert _address(e.memory) == e.slot.storage.data_ptr() + rel[0]
                assert _address(e.memory) % align.memory == 0
        assert cursor == chunk.stop
        assert chunk.used == any(e.slot is not None for e in chunk.extents)
    used = sum(e.stop - e.start for c in chunks for e in c.extents if e.slot is not None)
    assert used == sum(sizes) - sum(b - a for s in slots for a, b in s.zeros)


def test_a_large_placed_storage_is_in_place_but_for_its_ends():
    t = torch.randn(1 << 20)  # 4 MiB, at 64 bytes into a page
    slot = _slot(t)
    slot.offset = 3 * BLOCK + slot.storage.data_ptr() % BLOCK
    nbytes = slot.offset + slot.nbytes + BLOCK

    def in_place(align: Alignment | None) -> int:
        chunks = plan_chunks([slot], nbytes, 1 << 20, align)
        return sum(e.stop - e.start for c in chunks for e in c.extents if e.memory is not None)

    assert in_place(Alignment()) >= slot.nbytes - 2 * BLOCK
    assert in_place(None) == 0  # nothing in place unless asked
    slot.offset += 64  # its address no longer lines up with its place in the file
    assert in_place(Alignment()) == 0  # all through staging
    assert in_place(Alignment(4, 512)) >= slot.nbytes - 2 * 512  # but for an NVMe drive
    assert in_place(Alignment(1, 1)) == slot.nbytes  # buffered I/O: all of it
