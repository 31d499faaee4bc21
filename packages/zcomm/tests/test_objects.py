"""`zcomm.all_gather_object`: every rank's picklable object, in rank order, without NumPy."""

from __future__ import annotations

from typing import Any

import pytest

import zcomm
from zcomm.testing import DistributedTest


class TestAllGatherObject(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_every_rank_gets_every_object_in_order(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        # sizes differ per rank (padding), one rank sends an empty string, one None
        mine = {"rank": rank, "blob": b"x" * (100 * rank), "text": "" if rank == 1 else "r"}
        found: list[Any] = [None] * world_size
        zcomm.all_gather_object(found, mine)
        assert [f["rank"] for f in found] == list(range(world_size))
        assert [len(f["blob"]) for f in found] == [100 * r for r in range(world_size)]
        nones: list[Any] = [0] * world_size
        zcomm.all_gather_object(nones, None)
        assert nones == [None] * world_size
        # on a subgroup: its ranks only
        if world_size == 4:
            group = zcomm.new_group([1, 3])
            if rank in (1, 3):
                pair: list[Any] = [None, None]
                zcomm.all_gather_object(pair, rank * 10, group=group)
                assert pair == [10, 30]
        wrong = world_size + 1
        with pytest.raises(ValueError, match=f"object_list has {wrong} slots, the group"):
            zcomm.all_gather_object([None] * wrong, "x")
