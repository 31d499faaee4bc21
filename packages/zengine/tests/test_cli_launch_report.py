"""``zengine launch`` and ``zengine report``: DeepSpeed's launcher and environment report for
users without the compatibility package, run as commands (the ``zengine`` console script and
``python -m zengine``), real processes throughout."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

# A DeepSpeed example's script on zengine: --local_rank from the launcher,
# --deepspeed/--deepspeed_config from add_config_arguments, initialize(args=...)
SCRIPT = """
import argparse, json, os, sys
import torch
import zengine
from zengine import add_config_arguments

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", required=True)
args = add_config_arguments(parser).parse_args()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
engine, _, _, _ = zengine.initialize(args=args, model=model, model_parameters=model.parameters())
for step in range(2):
    loss = engine(torch.ones(2, 4) * (step + 1)).pow(2).mean()
    engine.backward(loss)
    engine.step()
rank = torch.distributed.get_rank()
found = {"rank": rank, "world": torch.distributed.get_world_size(), "argv": sys.argv[1:],
         "local_rank": args.local_rank, "steps": engine.global_steps,
         "weight": engine.module.weight.detach().flatten().tolist()}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(found, f)
"""
CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _zengine() -> list[str]:
    found = shutil.which("zengine", path=str(Path(sys.executable).parent))
    assert found is not None, "the zengine console script is not installed (pip install -e)"
    return [found]


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_launch_two_ranks(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    (tmp_path / "out").mkdir()
    cmd = [*_zengine(), "launch", "--num_gpus", "2", "--master_port", str(_free_port())]
    cmd += ["train.py", "--deepspeed", "--deepspeed_config", "ds.json", "--out", "out"]
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(found):
        assert result["world"] == 2
        assert result["rank"] == rank
        assert result["argv"][0] == f"--local_rank={rank}"
        assert result["local_rank"] == rank
        assert result["steps"] == 2
    assert found[0]["weight"] == found[1]["weight"]  # data parallel: the ranks agree


def test_launch_help_and_refusal(tmp_path: Path) -> None:
    proc = _run([sys.executable, "-m", "zengine", "launch", "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage: zengine launch" in proc.stdout
    for flag in ("--num_gpus", "--hostfile", "--include", "--exclude", "--launcher"):
        assert flag in proc.stdout
    (tmp_path / "hostfile").write_text("node-a slots=2\n")
    proc = _run([*_zengine(), "launch", "-H", "hostfile", "-e", "node-b", "t.py"], tmp_path)
    assert proc.returncode == 2
    assert "--exclude names host 'node-b', which the hostfile does not list" in proc.stderr


def test_report(tmp_path: Path) -> None:
    proc = _run([sys.executable, "-m", "zengine", "report", "--nvme-path", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name in ("zpipe", "zcomm", "zpartition", "zoffload", "zengine", "torch", "deepspeed"):
        assert f"\n{name} ..." in out
    assert "zstack: features on this machine" in out
    gloo = "[YES]" if dist.is_gloo_available() else "[NO]"
    assert any(line.startswith("gloo ...") and gloo in line for line in out.splitlines())
    assert f"O_DIRECT under {tmp_path}" in out


def test_report_json(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder"
    proc = _run([*_zengine(), "report", "--json", "--nvme-path", str(missing)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    features = {f["name"]: f for f in report["features"]}
    assert features["gloo"]["available"] == dist.is_gloo_available()
    probe = features[f"O_DIRECT under {missing}"]
    assert probe["available"] is False
    assert probe["detail"].startswith("cannot write there")
    assert dict(report["packages"])["zengine"].startswith("0.")
    # which deepspeed is installed, if any, is said plainly
    assert report["deepspeed"] in ("zstack", "deepspeed", "not installed")
