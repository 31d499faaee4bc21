"""``ds_report`` (DeepSpeed's environment report) on zstack: its command line (``cli_main``,
which the console script and ``python -m deepspeed.env_report`` call; test_entry_points.py runs
both as commands). It says that this ``deepspeed`` is zstack's compatibility package, prints
DeepSpeed's op table with what stands in for each op, and zengine's report of the packages and
the features this machine has."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import deepspeed
from deepspeed.env_report import cli_main


def test_ds_report(capsys: pytest.CaptureFixture[str]) -> None:
    cli_main([])
    out = capsys.readouterr().out
    assert f"deepspeed {deepspeed.__version__} is zstack's compatibility package" in out
    assert "DeepSpeed C++/CUDA extension op report (zstack)" in out
    for op in ("cpu_adam", "fused_adam", "async_io"):
        assert any(line.startswith(f"{op} ...") and "[OKAY]" in line for line in out.splitlines())
    assert "zstack's compatibility package (" in out  # the packages' table names it too
    gloo = "[YES]" if dist.is_gloo_available() else "[NO]"
    assert any(line.startswith("gloo ...") and gloo in line for line in out.splitlines())
    for feature in ("CUDA", "NCCL", "MPI", "pinned host memory", "bf16", "fp16", "safetensors"):
        assert f"\n{feature} ..." in out


def test_flags(capsys: pytest.CaptureFixture[str]) -> None:
    cli_main(["--hide_operator_status", "--hide_errors_and_warnings"])
    out = capsys.readouterr().out
    assert "op report" not in out
    assert "zstack: features on this machine" in out
    assert "is zstack's compatibility package" in out
    with pytest.raises(SystemExit) as exit:
        cli_main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "--hide_operator_status" in out
    assert "--hide_errors_and_warnings" in out
