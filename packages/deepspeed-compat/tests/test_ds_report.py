"""``ds_report`` (DeepSpeed's environment report) on zstack: the console script and ``python -m
deepspeed.env_report``, run as commands. It says that this ``deepspeed`` is zstack's
compatibility package, prints DeepSpeed's op table with what stands in for each op, and
zengine's report of the packages and the features this machine has."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

import deepspeed


def _ds_report(*args: str) -> subprocess.CompletedProcess[str]:
    found = shutil.which("ds_report", path=str(Path(sys.executable).parent))
    assert found is not None, "the ds_report console script is not installed (pip install -e)"
    return subprocess.run([found, *args], capture_output=True, text=True, timeout=300)


def test_ds_report() -> None:
    proc = _ds_report()
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"deepspeed {deepspeed.__version__} is zstack's compatibility package" in out
    assert "DeepSpeed C++/CUDA extension op report (zstack)" in out
    for op in ("cpu_adam", "fused_adam", "async_io"):
        assert any(line.startswith(f"{op} ...") and "[OKAY]" in line for line in out.splitlines())
    assert "zstack's compatibility package (" in out  # the packages' table names it too
    gloo = "[YES]" if dist.is_gloo_available() else "[NO]"
    assert any(line.startswith("gloo ...") and gloo in line for line in out.splitlines())
    for feature in ("CUDA", "NCCL", "MPI", "pinned host memory", "bf16", "fp16", "safetensors"):
        assert f"\n{feature} ..." in out


def test_flags_and_module_entry() -> None:
    proc = _ds_report("--hide_operator_status", "--hide_errors_and_warnings")
    assert proc.returncode == 0, proc.stderr
    assert "op report" not in proc.stdout
    assert "zstack: features on this machine" in proc.stdout
    proc = _ds_report("--help")
    assert proc.returncode == 0
    assert "--hide_operator_status" in proc.stdout
    assert "--hide_errors_and_warnings" in proc.stdout
    cmd = [sys.executable, "-m", "deepspeed.env_report", "--hide_operator_status"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "is zstack's compatibility package" in proc.stdout
