"""The ``deepspeed`` command (zcomm's launcher behind DeepSpeed's arguments), run as a user runs
it: the console script, real processes, torchrun underneath.

- ``deepspeed --num_gpus 2 launched_train.py --deepspeed ds.json``: two CPU ranks of one node,
  each given ``--local_rank=N`` before its own arguments, train through ``deepspeed.initialize``
  over gloo; the ranks' losses after the same seed agree in count and the world is 2.
- Two nodes on this machine through a hostfile (``localhost`` and ``127.0.0.1``, one slot
  each) and ``--launcher local``: two torchrun agents (``--nnodes 2``), world 2, each rank on
  its own node, ``.deepspeed_env`` exported to both.
- DeepSpeed's errors: a bad hostfile line, an unknown ``--include`` host, a refused launcher.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deepspeed.launcher import runner

SCRIPT = Path(__file__).parent / "scripts" / "launched_train.py"
CONFIG = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _deepspeed() -> list[str]:
    """The installed console script (next to this interpreter), as a user types it."""
    found = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert found is not None, "the deepspeed console script is not installed (pip install -e)"
    return [found]


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _results(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture
def job(tmp_path: Path) -> Path:
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    (tmp_path / "out").mkdir()
    return tmp_path


def test_one_node_two_ranks(job: Path) -> None:
    cmd = [*_deepspeed(), "--num_gpus", "2", "--master_port", str(_free_port())]
    cmd += [str(SCRIPT), "--deepspeed", "ds.json", "--out", "out"]
    proc = _run(cmd, job)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(job / "out", 2)
    for rank, found in enumerate(results):
        assert found["rank"] == rank
        assert found["world"] == 2
        # DeepSpeed's launcher passes --local_rank=N first, then the script's own arguments
        assert found["argv"] == [f"--local_rank={rank}", "--deepspeed", "ds.json", "--out", "out"]
        assert found["local_rank_arg"] == found["local_rank_env"] == rank
        assert found["deepspeed_arg"] == "ds.json"
        assert found["global_steps"] == 2
        assert len(found["losses"]) == 2
        assert (found["cross_rank"], found["cross_size"]) == ("0", "1")


def test_two_nodes_through_the_hostfile(job: Path) -> None:
    (job / "hostfile").write_text(
        "# two names for this machine\nlocalhost slots=1\n127.0.0.1 slots=1\n"
    )
    (job / ".deepspeed_env").write_text("ZSTACK_LAUNCH_TEST=from the env file\n")
    cmd = [*_deepspeed(), "--hostfile", "hostfile", "--launcher", "local"]
    cmd += ["--master_port", str(_free_port()), "--no_local_rank"]
    cmd += [str(SCRIPT), "--deepspeed", "ds.json", "--out", "out"]
    proc = _run(cmd, job)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # one torchrun agent per host of the hostfile, each told it is one of two nodes
    assert proc.stderr.count("--nnodes=2") == 2, proc.stderr
    results = _results(job / "out", 2)
    for rank, found in enumerate(results):
        assert found["world"] == 2
        assert found["group_rank"] == found["cross_rank"] == str(rank)  # node = rank here
        assert found["cross_size"] == "2"
        assert found["local_rank_env"] == 0
        assert found["argv"] == ["--deepspeed", "ds.json", "--out", "out"]  # --no_local_rank
        assert found["from_env_file"] == "from the env file"


def test_a_failing_rank_fails_the_launch(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text(
        "import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n"
    )
    cmd = [*_deepspeed(), "--num_gpus", "2", "--master_port", str(_free_port()), "fail.py"]
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("worker-0 slots=2\nworker-1 slot=2\n")
    proc = _run([*_deepspeed(), "-H", "hostfile", "train.py"], tmp_path)
    assert proc.returncode == 2
    assert "hostfile:2: expected 'HOST slots=N'" in proc.stderr
    assert "worker-1 slot=2" in proc.stderr
    (tmp_path / "hostfile").write_text("worker-0 slots=2\n")
    with pytest.raises(ValueError, match="--include names host 'worker-9'"):
        runner.main(["-H", str(tmp_path / "hostfile"), "-i", "worker-9:0", "train.py"])
    (tmp_path / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    with pytest.raises(ValueError, match="--launcher openmpi runs every slot of the hostfile"):
        runner.main(
            ["-H", str(tmp_path / "hostfile"), "--launcher", "openmpi", "-i", "worker-0", "t.py"]
        )
    with pytest.raises(ValueError, match="--autotuning tune: zstack has no autotuner"):
        runner.main(["--autotuning", "tune", "train.py"])


def test_help_and_module_entry() -> None:
    for cmd in (_deepspeed(), [sys.executable, "-m", "deepspeed.launcher.runner"]):
        proc = _run([*cmd, "--help"], Path.cwd(), timeout=120)
        assert proc.returncode == 0, proc.stderr
        for flag in ("--num_gpus", "--hostfile", "--include", "--launcher", "--no_local_rank"):
            assert flag in proc.stdout
