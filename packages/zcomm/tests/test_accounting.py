"""Accounting: bytes, count and time per operation, off by default, as a table."""

from __future__ import annotations

import pytest
import torch

import zcomm
from zcomm.testing import DistributedTest


class TestAccounting(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_off_by_default(self, world_size: int) -> None:
        zcomm.all_reduce(torch.ones(10))
        assert zcomm.comm_summary() == {}

    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_records_bytes_count_and_time(self, world_size: int) -> None:
        zcomm.enable_comm_accounting()
        for _ in range(3):
            zcomm.all_reduce(torch.ones(256))
        zcomm.all_gather_into_tensor(
            torch.empty(8 * world_size), torch.ones(8), async_op=True
        ).wait()
        zcomm.all_to_all_single(torch.empty(4 * world_size), torch.ones(4 * world_size))
        summary = zcomm.comm_summary()
        if world_size == 1:
            assert summary == {}  # the fast path sends nothing, so there is nothing to count
            return
        exchanged = summary["all_to_all_single"]  # as nccl-tests' alltoall: (n - 1) / n
        assert exchanged.busbw == pytest.approx(exchanged.algbw * (world_size - 1) / world_size)
        assert summary["all_reduce"].count == 3
        assert summary["all_reduce"].bytes == 3 * 256 * 4
        assert summary["all_reduce"].seconds > 0
        assert summary["all_reduce"].busbw == pytest.approx(
            summary["all_reduce"].algbw * 2 * (world_size - 1) / world_size
        )
        assert summary["all_gather_into_tensor"].bytes == 8 * world_size * 4
        # one node (the harness's launcher variables): every byte within it
        assert summary["all_reduce"].intra_node_bytes == 3 * 256 * 4
        assert summary["all_reduce"].inter_node_bytes == 0
        total = 3 * 256 * 4 + 8 * world_size * 4 + 4 * world_size * 4
        assert zcomm.comm_bytes_by_link() == {"intra_node": total, "inter_node": 0}
        table = zcomm.log_summary(show=False)
        assert table.splitlines()[0].startswith("| op | count | total MB")
        assert any(line.startswith("| all_reduce | 3 |") for line in table.splitlines())
        zcomm.reset_comm_accounting()
        assert zcomm.comm_summary() == {}
        assert zcomm.comm_bytes_by_link() == {"intra_node": 0, "inter_node": 0}

    @pytest.mark.parametrize("world_size", [2])
    def test_point_to_point_is_counted(self, world_size: int) -> None:
        zcomm.enable_comm_accounting()
        buf = torch.ones(16)
        if zcomm.get_rank() == 0:
            zcomm.send(buf, 1)
            assert zcomm.comm_summary()["send"].bytes == 64
        else:
            zcomm.recv(buf, 0)
            assert zcomm.comm_summary()["recv"].count == 1


def test_enable_rejects_a_non_bool() -> None:
    with pytest.raises(TypeError, match=r"enable_comm_accounting\(enabled=\.\.\.\)"):
        zcomm.enable_comm_accounting("yes")  # type: ignore[arg-type]
