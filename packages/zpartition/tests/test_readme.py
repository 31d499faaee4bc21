"""The example in this package's README runs, at world sizes 1 and 2."""

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
    def test_example_runs(self, world_size: int) -> None:
        code = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
        assert code is not None
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.group(1), str(README), "exec"), {})
        lines = out.getvalue().splitlines()
        assert lines[0] == f"NOT_AVAILABLE torch.Size([64, 16]) {1024 // world_size}"
        assert lines[1] == "torch.Size([1, 64])"
