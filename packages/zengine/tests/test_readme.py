"""The example in this package's README runs and trains, at world sizes 1 and 2."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from zcomm.testing import DistributedTest

README = Path(__file__).resolve().parents[1] / "README.md"


class TestReadme(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_example_trains(self, world_size: int) -> None:
        code = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
        assert code is not None
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.group(1), str(README), "exec"), {})
        loss = float(re.search(r"final loss (\S+),", out.getvalue()).group(1))
        assert loss < 1.0  # it starts near 16
        assert f"on {-(-1153 // world_size)} gradient" in out.getvalue()
