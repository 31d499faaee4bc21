"""The watchdog: a frozen rank and ranks waiting in different collectives are named within
the bound; a rank that computes longer than the bound is waited for ([Note: the watchdog])."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import zcomm
from zcomm.testing import DistributedTest

BOUND = 3.0  # seconds: short, so that the tests are quick


class TestWatchdog(DistributedTest):
    world_size = 2
    exec_timeout = 120.0  # a watchdog that never fires fails here, not after 30 minutes

    def test_frozen_rank_long_work_and_ranks_out_of_step(self) -> None:
        before = zcomm.watchdog_seconds()
        zcomm.set_watchdog(BOUND)
        rank = zcomm.get_rank()
        try:
            self._long_work_is_waited_for(rank)
            self._frozen_rank_is_named(rank)
            self._ranks_out_of_step_are_named(rank)
        finally:
            zcomm.set_watchdog(before)
            zcomm.set_activity(zcomm.CALLS[0], 0)

    def _long_work_is_waited_for(self, rank: int) -> None:
        zcomm.set_activity("forward", 1)
        if rank == 1:
            time.sleep(2.5 * BOUND)  # computing: alive, its heartbeat goes on
        x = torch.ones(4)
        zcomm.all_reduce(x)
        assert x.tolist() == [2.0] * 4

    def _frozen_rank_is_named(self, rank: int) -> None:
        zcomm.set_activity("backward", 2)
        pids = torch.tensor([os.getpid()], dtype=torch.int64)
        gathered = torch.zeros(2, dtype=torch.int64)
        zcomm.all_gather_into_tensor(gathered, pids)
        if rank == 1:
            time.sleep(1.0)  # a heartbeat or two with this call and step goes out first
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen until rank 0 names it
            zcomm.all_reduce(torch.ones(1))  # the one rank 0 waited in, to leave both clean
            return
        try:
            with pytest.raises(zcomm.RankUnresponsiveError) as info:
                zcomm.all_reduce(torch.ones(1))
        finally:
            os.kill(int(gathered[1]), signal.SIGCONT)
        message = str(info.value)
        assert info.value.silent_rank == 1
        assert "rank 1 has not answered" in message
        assert "its last heartbeat: backward, step 2" in message
        assert "this rank (0) is in backward, step 2, waiting" in message
        assert "in all_reduce on the world group (2 ranks)" in message

    def _ranks_out_of_step_are_named(self, rank: int) -> None:
        other = zcomm.new_group([0, 1])  # the same ranks, another group: never pairs
        zcomm.barrier()
        zcomm.set_activity("step" if rank == 0 else "forward", 3)
        x = torch.ones(2)
        with pytest.raises(zcomm.RanksOutOfStepError) as info:
            zcomm.all_reduce(x, group=None if rank == 0 else other)
        message = str(info.value)
        assert "the ranks are out of step" in message
        mine, theirs = ("step", "forward") if rank == 0 else ("forward", "step")
        assert f"this rank ({rank}) is in {mine}, step 3, waiting" in message
        assert f"rank {1 - rank} is in {theirs}, step 3, waiting in all_reduce on" in message
        # each rank now joins the collective the other waits in, so both complete; not at
        # once: the other rank raises too (the verdict this one left in the store), which a
        # completed wait would not let it
        time.sleep(BOUND)
        zcomm.all_reduce(torch.ones(2), group=other if rank == 0 else None)
