"""The example in the workspace README runs and says what it claims."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_example_runs():
    if not README.is_file():
        pytest.skip("not in a zstack checkout")
    code = re.search(r"## zpipe in 30 lines\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.group(1), str(README), "exec"), {})
    printed = out.getvalue()
    assert "ZeroBubbleH1Schedule 27.0 11.1% [4.0, 4.0, 4.0, 4.0]" in printed
    assert "overwrites buffer 0 with micro-batch 1 while it holds micro-batch 0" in printed
