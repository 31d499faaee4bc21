"""The NVMe store behind ``offload_param: {device: nvme}``, on real files: shards come back
bit-exact, unchanged shards are not written again, and shards are read ahead in the order
they were fetched before ([Note: reading shards ahead])."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import zoffload
from zengine._offload import NvmeShardStore
from zoffload import _nvme

NUMEL = 10_000


def away(shard: torch.Tensor) -> bool:
    return shard.untyped_storage().nbytes() == 0


def store_of(
    tmp_path: Path, read_ahead: int
) -> tuple[NvmeShardStore, list[torch.Tensor], list[torch.Tensor]]:
    """A store holding five shards (evicted), and copies of their values."""
    store = NvmeShardStore(tmp_path, rank=0, read_ahead=read_ahead)
    shards = [torch.randn(NUMEL) for _ in range(5)]
    expected = [s.clone() for s in shards]
    for shard in shards:
        store.evict(shard)
    return store, shards, expected


def settle(store: NvmeShardStore, shards: list[torch.Tensor]) -> None:
    """Wait for reads in flight (what the next fetch would do)."""
    for shard in shards:
        handle = store._held[id(shard)][0]
        handle.wait()


def test_shards_come_back_and_unchanged_ones_are_not_rewritten(tmp_path: Path) -> None:
    store, shards, expected = store_of(tmp_path, read_ahead=0)
    assert all(map(away, shards))
    store.fetch(shards)
    assert all(torch.equal(s, e) for s, e in zip(shards, expected, strict=True))
    files = {p: p.stat().st_ino for p in store.folder.glob("*.swap")}
    assert len(files) == len(shards)
    shards[2].mul_(3)  # an optimizer step on one shard
    for shard in shards:
        store.evict(shard)
    rewritten = [p for p, inode in files.items() if p.stat().st_ino != inode]
    assert len(rewritten) == 1
    store.fetch(shards)
    assert torch.equal(shards[2], expected[2] * 3)
    assert torch.equal(shards[0], expected[0])
    store.close()
    assert not store.folder.exists()


def test_the_next_shards_are_read_before_they_are_asked_for(tmp_path: Path) -> None:
    store, shards, _ = store_of(tmp_path, read_ahead=2 * NUMEL)
    for shard in shards:  # a forward: one unit after the other; the store learns the order
        store.fetch([shard])
    for shard in shards:
        store.evict(shard)
    store.fetch([shards[0]])
    settle(store, shards)
    # the two that followed the first last time, and no more (the budget)
    assert [away(s) for s in shards] == [False, False, False, True, True]
    store.fetch([shards[1]])
    settle(store, shards)
    assert [away(s) for s in shards] == [False, False, False, False, True]
    store.close()


def test_a_backward_order_is_told_from_a_forward_one(tmp_path: Path) -> None:
    store, shards, _ = store_of(tmp_path, read_ahead=NUMEL)
    for order in (shards, shards[::-1]):  # forward then backward, each unit fetched again
        for shard in order:
            store.fetch([shard])
            store.evict(shard)
    # a backward again: after 4, 3 comes 2 (a forward's 3 would be followed by 4)
    store.fetch([shards[4]])
    store.evict(shards[4])
    store.fetch([shards[3]])
    settle(store, shards)
    assert not away(shards[2])
    assert away(shards[4])
    store.close()


def test_a_wrong_guess_costs_memory_not_values(tmp_path: Path) -> None:
    store, shards, expected = store_of(tmp_path, read_ahead=10 * NUMEL)
    store.fetch(shards)  # learnt: 0, 1, 2, 3, 4
    for shard in shards:
        store.evict(shard)
    store.fetch([shards[4], shards[0]])  # another order: reads ahead what it no longer needs
    store.fetch(shards)
    assert all(torch.equal(s, e) for s, e in zip(shards, expected, strict=True))
    store.close()


def test_held_shards_stay_in_memory_until_the_hold_ends(tmp_path: Path) -> None:
    # the engine holds them through the backward before a step, which needs them all
    store, shards, expected = store_of(tmp_path, read_ahead=0)
    store.fetch(shards)
    store.holding = True
    for shard in shards:
        store.evict(shard)
    assert not any(map(away, shards))
    store.holding = False
    for shard in shards:
        store.evict(shard)
    assert all(map(away, shards))
    store.fetch(shards)
    assert all(torch.equal(s, e) for s, e in zip(shards, expected, strict=True))
    store.close()


def test_shards_written_behind_come_back_and_a_failed_write_is_noted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # [Note: writing shards behind]: a tiled step's shards go to their files in the
    # background, at most `read_ahead` elements in flight; each comes back bit-exact
    store, shards, expected = store_of(tmp_path, read_ahead=2 * NUMEL)
    store.fetch(shards)
    for shard in shards:
        shard.add_(1)  # a step: every shard changes, every one is rewritten
    store.write_behind = True
    for shard in shards:
        store.evict(shard)
        handles = [store._held[id(s)][0] for s in shards]
        in_flight = [h for h in handles if h.state == "offloading" and not h.done()]
        assert sum(h.nbytes // 4 for h in in_flight) <= 2 * NUMEL  # the budget
    for shard in shards:
        store.evict(shard)  # the step's final sweep: a shard on its way is left alone
    store.write_behind = False
    store.fetch(shards)  # each waits for its write, then reads it back
    assert all(torch.equal(s, e + 1) for s, e in zip(shards, expected, strict=True))
    assert store.take_failure() is None
    # a write behind that fails leaves its shard in memory, bit-exact, and is agreed later
    real = _nvme._pwrite_all

    def failing(fd: int, data: list[memoryview], offset: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_nvme, "_pwrite_all", failing)
    shards[1].mul_(2)
    store.write_behind = True
    store.evict(shards[1])
    assert isinstance(store.take_failure(), zoffload.OffloadError)  # waited for, then taken
    assert not away(shards[1])
    assert torch.equal(shards[1], (expected[1] + 1) * 2)
    monkeypatch.setattr(_nvme, "_pwrite_all", real)
    store.write_behind = False
    store.evict(shards[1])  # written now, and read back
    assert away(shards[1])
    store.fetch([shards[1]])
    assert torch.equal(shards[1], (expected[1] + 1) * 2)
    store.close()


def test_shards_the_step_overwrites_come_back_zeroed_without_a_read(tmp_path: Path) -> None:
    # [Note: shards the step overwrites]
    store, shards, expected = store_of(tmp_path, read_ahead=0)
    before = zoffload.nvme_stats()
    store.reclaim(shards[:2])
    assert (zoffload.nvme_stats() - before).bytes_read == 0
    assert not any(map(away, shards[:2]))
    assert all(map(away, shards[2:]))
    assert all(not s.any() for s in shards[:2])
    assert len(list(store.folder.glob("*.swap"))) == 3  # their files went
    for shard, e in zip(shards[:2], expected[:2], strict=True):
        shard.copy_(e * 2)  # the step's write-back
        store.evict(shard)
    assert len(list(store.folder.glob("*.swap"))) == 5
    store.fetch(shards)
    assert torch.equal(shards[1], expected[1] * 2)
    assert torch.equal(shards[2], expected[2])
    store.reclaim(shards[:1])  # in memory already: kept as it is
    assert torch.equal(shards[0], expected[0] * 2)
    store.close()
