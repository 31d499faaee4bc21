"""DeepSpeed runs on a CPU machine as Hugging Face's docs write them, with no
``PartialState(backend="gloo")`` first: Transformers' Trainer and an Accelerate loop under
``torchrun --nproc-per-node 2``, and the loop under ``accelerate launch --use_deepspeed
--zero_stage 3``. Accelerate sees the two ranks (the compat package's ``init_distributed``
gives its state the backend: [Note: Accelerate's world on CPU]) and the losses equal the same
run's without DeepSpeed (DDP over gloo). One launch per way of starting (scripts/cpu_as_written.py):
what is under test is the first state a process makes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _helpers import SCRIPTS, save_tiny_model, torchrun

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="what a machine without an accelerator does"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("cpu_model") / "model")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def accelerate_launch(run_dir: Path, model_dir: Path) -> dict[str, Any]:
    """``accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2`` of the script."""
    result = run_dir / "cpu_as_written.json"
    env = {**os.environ, "ZSTACK_RESULT": str(result), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--use_deepspeed",
        "--zero_stage=3",
        "--num_processes=2",
        "--num_machines=1",
        f"--main_process_port={_free_port()}",
        str(SCRIPTS / "cpu_as_written.py"),
        str(run_dir),
        str(model_dir),
        "accelerate_launch",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not result.exists():
        raise AssertionError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-6000:]}\n"
            f"{done.stderr[-12000:]}"
        )
    found: dict[str, Any] = json.loads(result.read_text())
    return found


@pytest.mark.parametrize("mode", ["trainer", "accelerate", "accelerate_launch"])
def test_deepspeed_on_cpu_as_written_sees_the_world_and_equals_ddp(
    tmp_path: Path, model_dir: Path, mode: str
) -> None:
    if mode == "accelerate_launch":
        runs = accelerate_launch(tmp_path, model_dir)
    else:
        runs = torchrun("cpu_as_written.py", str(tmp_path), str(model_dir), mode)
    zero3, ddp = runs["zero3"], runs["ddp"]
    assert zero3["deepspeed"], f"{mode}: the run did not use DeepSpeed"
    assert not ddp["deepspeed"]
    assert zero3["world"] == 2, f"{mode}: Accelerate saw {zero3['world']} ranks, not 2"
    assert ddp["world"] == 2
    assert len(zero3["losses"]) == 3
    assert len(set(ddp["losses"])) == 3  # the weights move: the comparison means something
    assert zero3["losses"] == pytest.approx(ddp["losses"], rel=1e-5, abs=0)
