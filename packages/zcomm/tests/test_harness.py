"""The harness itself: it is tested by tests that use it, and by calling test classes whose
name starts with an underscore (pytest does not collect them) to see how failures come back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zcomm
from zcomm.testing import DistributedTest, preferred_dtype

# A module global lives on in each worker between tests (the module is loaded once there).
_kept: dict[str, Any] = {}


class TestRanksRunTheMethod(DistributedTest):
    world_size = (1, 2, 4)

    def test_every_rank_runs_with_its_environment(self) -> None:
        rank, size = zcomm.get_rank(), zcomm.get_world_size()
        assert os.environ["RANK"] == str(rank)
        assert os.environ["WORLD_SIZE"] == str(size)
        t = torch.tensor([float(rank)])
        zcomm.all_reduce(t)
        assert t.item() == size * (size - 1) / 2

    def test_fixtures_reach_the_ranks(self, tmp_path: Path) -> None:
        # every rank gets the same fixture value: the one directory, which each writes into
        (tmp_path / f"rank{zcomm.get_rank()}").write_text("here")
        zcomm.barrier()
        size = zcomm.get_world_size()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"rank{i}" for i in range(size))

    def test_each_test_starts_from_torchs_default_seed(self) -> None:
        # As in a fresh process: every rank draws the same numbers, whatever ran before.
        mine = torch.rand(2)
        gathered = torch.empty(2 * zcomm.get_world_size())
        zcomm.all_gather_into_tensor(gathered, mine)
        assert torch.equal(gathered.view(-1, 2), mine.expand(zcomm.get_world_size(), 2))


class TestParametrizedWorldSize(DistributedTest):
    world_size = 4  # overridden by the parameter

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_parameter_overrides_class_attribute(self, world_size: int) -> None:
        assert zcomm.get_world_size() == world_size


class TestWithoutInit(DistributedTest):
    world_size = 2
    init_distributed = False

    def test_environment_is_set_but_nothing_started(self) -> None:
        assert not zcomm.is_initialized()
        assert os.environ["WORLD_SIZE"] == "2"


class TestWithoutEnvironment(DistributedTest):
    world_size = 2
    set_dist_env = False

    def test_started_without_torchrun_variables(self) -> None:
        assert "RANK" not in os.environ
        assert zcomm.get_world_size() == 2


class TestMarkedWorldSize(DistributedTest):
    world_size = 1

    @pytest.mark.world_size(2)
    def test_mark_overrides_class_attribute(self) -> None:
        assert zcomm.get_world_size() == 2


class TestReuseDistEnv(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_1_keeps_its_group(self) -> None:
        _kept["group"] = dist.distributed_c10d._get_default_group()

    def test_2_finds_the_same_group(self) -> None:
        assert dist.distributed_c10d._get_default_group() is _kept.pop("group")


class TestOutputAndSkip(DistributedTest):
    world_size = 2

    def test_output_of_ranks_is_shown_with_a_prefix(self) -> None:
        print(f"hello from rank {zcomm.get_rank()}")


def test_output_reaches_pytest_with_rank_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    TestOutputAndSkip().test_output_of_ranks_is_shown_with_a_prefix()
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out
    assert "[rank 1] hello from rank 1" in out


class _Skips(DistributedTest):
    world_size = 2

    def test_skips(self) -> None:
        pytest.skip("not on this machine")


def test_a_skip_in_the_ranks_skips_the_test() -> None:
    with pytest.raises(pytest.skip.Exception, match="not on this machine"):
        _Skips().test_skips()


class _Fails(DistributedTest):
    world_size = 2
    failure_grace = 5.0

    def test_rank_1_raises(self) -> None:
        if zcomm.get_rank() == 1:
            raise ValueError("boom from rank 1")

    def test_rank_1_raises_while_rank_0_waits(self) -> None:
        if zcomm.get_rank() == 1:
            raise ValueError("boom from rank 1")
        zcomm.all_reduce(torch.ones(1))


def test_failing_rank_traceback_is_shown() -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        _Fails().test_rank_1_raises()
    message = str(info.value)
    assert "_Fails::test_rank_1_raises (world_size=2) failed" in message
    assert "rank 1 raised" in message
    assert 'raise ValueError("boom from rank 1")' in message  # the source line of the traceback
    assert "ValueError: boom from rank 1" in message
    assert "rank 0" not in message  # rank 0 passed


def test_failing_rank_releases_a_rank_waiting_for_it() -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        _Fails().test_rank_1_raises_while_rank_0_waits()
    message = str(info.value)
    # The cause comes first; the waiting rank's error (or its kill) comes after it.
    assert message.index("boom from rank 1") < message.index("rank 0")


class _CannotConnect(DistributedTest):
    world_size = 2
    backend = "no-such-backend"

    def test_never_runs(self) -> None:
        raise AssertionError("the body must not run without a process group")


def test_a_group_that_cannot_be_set_up_is_tried_twice_then_named() -> None:
    start = time.monotonic()
    with (
        pytest.warns(RuntimeWarning, match="its ranks could not connect; ran it again"),
        pytest.raises(pytest.fail.Exception) as info,
    ):
        _CannotConnect().test_never_runs()
    message = str(info.value)
    assert "_CannotConnect::test_never_runs (world_size=2) failed" in message
    assert "rank 0 could not set up its process group (2 attempts" in message
    assert "no-such-backend" in message
    assert "the body must not run" not in message
    assert time.monotonic() - start < 120


class _Hangs(DistributedTest):
    world_size = 2
    exec_timeout = 2.0

    def test_rank_1_sleeps(self) -> None:
        if zcomm.get_rank() == 1:
            time.sleep(60)


def test_hanging_test_is_killed_with_a_message_naming_test_and_rank() -> None:
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as info:
        _Hangs().test_rank_1_sleeps()
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "_Hangs::test_rank_1_sleeps (world_size=2)" in message
    assert "rank 1 did not finish within 2 s and was killed" in message
    assert "in test_rank_1_sleeps" in message  # rank 1's stack, from faulthandler
    # The pool replaced the killed worker: the next test runs normally.
    TestRanksRunTheMethod().test_every_rank_runs_with_its_environment()


class _Probe(DistributedTest):
    world_size = 1

    def test_takes(self, value: Any) -> None:
        pass


def test_arguments_that_cannot_reach_the_ranks_are_named() -> None:
    with pytest.raises(TypeError, match=r"argument 'value' .* cannot be sent to the ranks"):
        _Probe().test_takes(value=lambda: None)


def test_bad_world_size_is_named() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        _Probe().test_takes(value=1, world_size=0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="world_size must be an int or a list"):
        _Probe().test_takes(value=1, world_size="2")  # type: ignore[call-arg]


def test_a_class_inside_a_function_is_refused() -> None:
    class Local(DistributedTest):
        world_size = 1

        def test_x(self) -> None:
            pass

    with pytest.raises(TypeError, match="must be defined at module level"):
        Local().test_x()


def test_preferred_dtype_on_cpu() -> None:
    assert preferred_dtype() == (torch.float16 if torch.cuda.is_available() else torch.bfloat16)
