"""Zero runs found on the host and handed back without writing ([Note: zero pages])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zoffload import release_pages
from zoffload._pages import ZERO_BLOCK, zero_runs


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_zero_runs_are_whole_blocks_of_zeros_merged() -> None:
    data = torch.ones(10 * ZERO_BLOCK + 5, dtype=torch.uint8)
    data[ZERO_BLOCK - 1 : 4 * ZERO_BLOCK + 1] = 0  # blocks 1-3 whole, 0 and 4 touched
    data[6 * ZERO_BLOCK :] = 0  # blocks 6-9 and the partial tail
    assert zero_runs(data) == [(ZERO_BLOCK, 4 * ZERO_BLOCK), (6 * ZERO_BLOCK, 10 * ZERO_BLOCK)]
    # unaligned: blocks count from the first byte (compared byte by byte), a shifted window
    assert zero_runs(data[1:]) == [(ZERO_BLOCK, 4 * ZERO_BLOCK), (6 * ZERO_BLOCK, 10 * ZERO_BLOCK)]
    assert zero_runs(torch.ones(4 * ZERO_BLOCK, dtype=torch.uint8)) == []
    assert zero_runs(torch.zeros(ZERO_BLOCK - 1, dtype=torch.uint8)) == []
    with pytest.raises(ValueError, match="flat uint8"):
        zero_runs(torch.zeros(4, ZERO_BLOCK))


def test_release_zeroes_and_hands_the_pages_back() -> None:
    data = torch.ones(64 << 20, dtype=torch.uint8)  # resident: every page written
    rss = _rss()
    middle = data[1000 : (40 << 20) + 7]
    release_pages(middle)
    assert rss - _rss() >= (40 << 20) - (1 << 20)
    assert not bool(middle.any())
    assert data[999].item() == 1  # the neighbours are untouched
    assert data[(40 << 20) + 7].item() == 1
    small = torch.ones(100, dtype=torch.uint8)
    release_pages(small[10:20])  # less than a page: written
    assert small.sum().item() == 90


def test_release_takes_any_dtype_and_zeroes_what_it_cannot_hand_back() -> None:
    floats = torch.ones(12 << 20)  # 48 MiB of fp32
    rss = _rss()
    release_pages(floats[3:-3])  # ends off the page boundaries
    assert rss - _rss() >= 40 << 20
    assert not bool(floats[3:-3].any())
    assert bool(floats[:3].eq(1).all())
    assert bool(floats[-3:].eq(1).all())
    strided = torch.ones(1 << 20, 4)[:, 1]  # not contiguous: zeroed element by element
    release_pages(strided)
    assert not bool(strided.any())
    shared = torch.ones(4 << 20).share_memory_()  # another process may map it: written
    release_pages(shared)
    assert not bool(shared.any())
