"""DeepSpeed's logging helpers in zengine.utils: log_dist's ranks, see_memory_usage."""

from __future__ import annotations

import contextlib
import io
import logging

import pytest

import zcomm
from zcomm.testing import DistributedTest
from zengine.utils import log_dist, logger, print_dist, see_memory_usage


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class TestOnRanks(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_log_dist_and_print_dist_speak_on_the_ranks_asked(self, world_size: int) -> None:
        kept = _Kept()
        logger.addHandler(kept)
        try:
            log_dist("to rank 0", ranks=[0])
            log_dist("to all", ranks=[-1])
            log_dist("to nobody")  # DeepSpeed's default under a process group
            log_dist("to the last", ranks=[world_size - 1], level=logging.WARNING)
        finally:
            logger.removeHandler(kept)
        rank = zcomm.get_rank()
        expected = [f"[Rank {rank}] to rank 0"] if rank == 0 else []
        expected.append(f"[Rank {rank}] to all")
        if rank == world_size - 1:
            expected.append(f"[Rank {rank}] to the last")
        assert kept.messages == expected
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_dist("hello", ranks=[0])
            see_memory_usage("before the model", force=True)
            see_memory_usage("not forced")
        lines = printed.getvalue().splitlines()
        if rank == 0:
            assert lines[:3] == ["[Rank 0] hello", "before the model", lines[2]]
            assert lines[2].startswith("MA ")
            assert lines[3].startswith("CPU Virtual Memory:  used = ")
            assert len(lines) == 4
        else:
            assert lines == []


def test_without_a_process_group_every_message_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    print_dist("alone")
    assert capsys.readouterr().out == "[Rank -1] alone\n"
