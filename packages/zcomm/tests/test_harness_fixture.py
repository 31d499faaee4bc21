"""`DistributedFixture` (DeepSpeed's): a fixture that runs on its own ranks before the test that
asks for it, and ``class_tmpdir``, the directory a test class shares with its fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _pytest.outcomes import Failed

import zcomm
from zcomm._dist_test import _run, fixture_class
from zcomm.testing import DistributedFixture, DistributedTest, get_master_port


@pytest.fixture(params=["a", "b"])
def tag(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class _Writes:
    world_size: Any

    def run(self, class_tmpdir: Any, tag: str) -> None:
        """Each rank writes what an all-reduce over the fixture's world gave it."""
        size = zcomm.get_world_size()
        assert size == self.world_size
        total = torch.ones(1)
        zcomm.all_reduce(total)
        (Path(class_tmpdir) / f"{tag}-{size}-{zcomm.get_rank()}").write_text(f"{total.item():g}")


class written_by_1(_Writes, DistributedFixture):
    world_size = 1


class written_by_2(_Writes, DistributedFixture):
    world_size = 2


class written_by_4(_Writes, DistributedFixture):
    world_size = 4


class TestDistributedFixture(DistributedTest):
    world_size = 2

    def test_fixtures_ran_first_on_their_own_ranks(
        self,
        written_by_1: None,
        written_by_2: None,
        written_by_4: None,
        class_tmpdir: Any,
        tag: str,
    ) -> None:
        assert zcomm.get_world_size() == 2  # the test runs at its own size
        for size in (1, 2, 4):
            for rank in range(size):
                assert (Path(class_tmpdir) / f"{tag}-{size}-{rank}").read_text() == str(size)

    def test_1_class_tmpdir_is_shared_by_the_tests_of_a_class(self, class_tmpdir: Any) -> None:
        if zcomm.get_rank() == 0:
            (Path(class_tmpdir) / "from-test-1").write_text("kept")

    def test_2_class_tmpdir_is_shared_by_the_tests_of_a_class(self, class_tmpdir: Any) -> None:
        assert (Path(class_tmpdir) / "from-test-1").read_text() == "kept"


class _fails_on_rank_1(DistributedFixture):
    world_size = 2

    def run(self) -> None:
        if zcomm.get_rank() == 1:
            raise RuntimeError("the fixture broke on rank 1")


def test_a_failing_fixture_names_its_rank() -> None:
    cls = fixture_class(__name__, "_fails_on_rank_1")
    assert cls is not None
    with pytest.raises(Failed, match=r"(?s)_fails_on_rank_1::run.*rank 1 raised.*broke on rank 1"):
        _run(cls, "run", {}, 2)  # what pytest's fixture setup calls


def test_a_fixture_has_one_world_size_and_takes_fixtures_by_name() -> None:
    with pytest.raises(TypeError, match=r"world_size must be one int, got \(1, 2\)"):

        class sizes(DistributedFixture):
            world_size = (1, 2)

    with pytest.raises(TypeError, match=r"run\(\) takes fixtures by name only"):

        class starred(DistributedFixture):
            world_size = 1

            def run(self, *args: Any) -> None:
                pass

    with pytest.raises(TypeError, match=r"define run\(self, <the fixtures it needs>\)"):

        class no_run(DistributedFixture):
            world_size = 1

    with pytest.raises(TypeError, match="a DistributedFixture must be defined at module level"):

        class local(DistributedFixture):
            world_size = 1

            def run(self) -> None:
                pass


def test_get_master_port_is_free() -> None:
    port = get_master_port()
    assert isinstance(port, str)
    assert 0 < int(port) < 65536
