"""The host pool: exact sizes, reuse across cycles without growth, release and trim."""

from __future__ import annotations

import pytest
import torch

import zoffload
from zoffload import HostPool


def test_blocks_are_the_size_asked_not_a_power_of_two():
    pool = HostPool()
    region = pool.allocate(5 * 4096 + 1, pinned=True)  # no CUDA here: plain memory
    assert region.nbytes == 6 * 4096  # a page multiple, not 8 pages
    assert not region.pinned
    assert region.tensor.data_ptr() % 4096 == 0
    stats = pool.stats()
    assert (stats.blocks, stats.reserved_bytes, stats.in_use_bytes) == (1, 6 * 4096, 6 * 4096)
    region.release()
    assert pool.stats().in_use_bytes == 0
    pool.close()


def test_regions_are_carved_first_fit_and_coalesced():
    pool = HostPool()
    big = pool.allocate(10 * 4096, pinned=False)
    big.release()
    parts = [pool.allocate(4096, pinned=False) for _ in range(10)]
    assert pool.stats().blocks_allocated == 1  # all ten carved from the one block
    assert sorted(p.offset for p in parts) == [i * 4096 for i in range(10)]
    for p in parts[::2] + parts[1::2]:
        p.release()
    whole = pool.allocate(10 * 4096, pinned=False)  # the free ranges merged back into one
    assert pool.stats().blocks_allocated == 1
    whole.release()
    pool.close()


def test_regions_do_not_overlap():
    pool = HostPool()
    regions = [pool.allocate(n, pinned=False) for n in (1, 5000, 4096, 12345)]
    for i, r in enumerate(regions):
        r.tensor.fill_(i)
    for i, r in enumerate(regions):
        assert bool((r.tensor == i).all())
    for r in regions:
        r.release()
    pool.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_hundred_cycles_allocate_nothing_after_the_first(tmp_path, device):
    pool = HostPool()
    off = zoffload.Offloader(pool=pool, nvme_path=tmp_path, chunk_bytes=64 << 10)
    params = {f"p{i}": torch.randn(1000 * (i + 1)) for i in range(5)}
    moments = {f"m{i}": torch.randn(3000) for i in range(3)}
    expected = {k: v.clone() for k, v in (params | moments).items()}
    after_first = None
    for cycle in range(100):
        h1 = off.offload(params, device)
        h2 = off.offload(moments, device, non_blocking=True)
        h2.reload()
        h1.reload(non_blocking=True).wait()
        if cycle == 0:
            after_first = pool.stats()
    final = pool.stats()
    assert after_first is not None
    assert final.blocks_allocated == after_first.blocks_allocated  # no growth, no re-pinning
    assert final.reserved_bytes == after_first.reserved_bytes
    assert final.in_use_bytes == 0
    assert final.regions_allocated > after_first.regions_allocated  # but it was used
    for k, v in (params | moments).items():
        assert torch.equal(v, expected[k]), k
    off.close()
    pool.close()


def test_trim_of_one_kind_of_block():
    pool = HostPool()
    pool.allocate(1 << 20, pinned=False).release()
    assert pool.trim(pinned=True) == 0  # no pinned block to give back
    assert pool.stats().blocks == 1
    assert pool.trim(pinned=False) == 1 << 20
    assert pool.stats().blocks == 0


def test_trim_and_close():
    pool = HostPool()
    kept = pool.allocate(4096, pinned=False)
    dropped = pool.allocate(1 << 20, pinned=False)
    dropped.release()
    assert pool.stats().blocks == 2
    assert pool.trim() == 1 << 20
    assert pool.stats().blocks == 1
    with pytest.raises(RuntimeError, match="live regions"):
        pool.close()
    kept.release()
    kept.release()  # idempotent
    pool.close()
    assert pool.stats().blocks == 0
