"""Point-to-point: a ring of sends, async pairs and batches, at world sizes 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch

import zcomm
from zcomm.testing import DistributedTest


class TestPointToPoint(DistributedTest):
    @pytest.mark.parametrize("world_size", [2, 4])
    def test_ring_with_blocking_send_recv(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        received = torch.empty(3)
        # Even ranks send first, odd ranks receive first: blocking calls cannot deadlock.
        if rank % 2 == 0:
            zcomm.send(torch.full((3,), float(rank)), right)
            assert zcomm.recv(received, left) == left
        else:
            zcomm.recv(received, left)
            zcomm.send(torch.full((3,), float(rank)), right)
        assert received.tolist() == [float(left)] * 3

    @pytest.mark.parametrize("world_size", [2, 4])
    def test_isend_irecv(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        received = torch.empty(2, dtype=torch.bfloat16)
        handles = [
            zcomm.irecv(received, left),
            zcomm.isend(torch.full((2,), float(rank), dtype=torch.bfloat16), right),
        ]
        for h in handles:
            h.wait()
        assert received.tolist() == [float(left)] * 2

    @pytest.mark.parametrize("world_size", [2, 4])
    def test_batch_isend_irecv_both_directions(self, world_size: int) -> None:
        # What a pipeline stage does: activations forward and gradients back at once.
        rank = zcomm.get_rank()
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        from_left, from_right = torch.empty(4), torch.empty(4)
        ops = [
            zcomm.P2POp(zcomm.isend, torch.full((4,), float(rank)), right),
            zcomm.P2POp(zcomm.irecv, from_left, left),
            zcomm.P2POp(zcomm.isend, torch.full((4,), -float(rank)), left),
            zcomm.P2POp(zcomm.irecv, from_right, right),
        ]
        handles = zcomm.batch_isend_irecv(ops)
        assert [h.op for h in handles] == ["send", "recv", "send", "recv"]
        for h in handles:
            h.wait()
        assert from_left.tolist() == [float(left)] * 4
        assert from_right.tolist() == [-float(right)] * 4

    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_bad_peers_name_the_argument(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        with pytest.raises(
            ValueError, match=rf"send\(dst={rank}\): that is this process's own rank"
        ):
            zcomm.send(torch.ones(1), rank)
        with pytest.raises(ValueError, match=rf"irecv\(src={world_size}\): not a rank"):
            zcomm.irecv(torch.ones(1), world_size)
        with pytest.raises(TypeError, match=r"isend\(tensor=\.\.\.\)"):
            zcomm.isend("data", 0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"ops\[0\]\): op must be zcomm.isend"):
            zcomm.batch_isend_irecv([zcomm.P2POp(zcomm.send, torch.ones(1), 0)])
        with pytest.raises(ValueError, match="the list is empty"):
            zcomm.batch_isend_irecv([])
