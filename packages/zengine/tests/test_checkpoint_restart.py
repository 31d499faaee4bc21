"""A rank killed during training under ``torchrun --max-restarts``: the job restarts, loads the
latest checkpoint and ends with the loss of a run that was never interrupted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("_restart_job.py")


def test_killed_rank_restarts_from_latest_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",  # gloo's connect sometimes fails on its own here: the world must come back anyway
        "--monitor-interval",
        "0.2",
        str(JOB),
        str(tmp_path / "ckpt"),
        str(tmp_path / "result.json"),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "result.json").read_text())
    assert report["attempt"] >= 1, report  # the first attempt died, a later one finished
    assert report["resumed_at"] in (4, 6), report  # from a checkpoint, not from the start
    assert report["final"] == report["reference"], report  # bit-identical
