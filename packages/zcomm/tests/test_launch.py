"""zcomm.launch: DeepSpeed's hostfile, ``--include``/``--exclude``, the exact commands built for
each node (torchrun, pdsh, srun), refusals with their reasons, and real launches on this
machine (``python -m zcomm.launch``: torchrun underneath, two ranks over gloo)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zcomm import launch
from zcomm.launch import (
    LaunchError,
    RankOptions,
    decode_world_info,
    encode_world_info,
    node_command,
    parse_hostfile,
    parse_inclusion_exclusion,
    pdsh_command,
    pdsh_kill_command,
    read_env_file,
    read_hostfile,
    resolve_resources,
    slurm_command,
    torchrun_args,
)
from zcomm.launch._rank import cores_for, parse_core_list, rank_argv
from zcomm.launch.node import select_node

PY = "/usr/bin/python3"


# --- the hostfile ---------------------------------------------------------------------------


def test_hostfile_in_order_with_comments() -> None:
    text = """
    # the cluster
    worker-1 slots=2
    worker-0 slots=4   # trailing comment
    10.0.0.7 slots=1 max_slots=2

    """
    assert parse_hostfile(text.splitlines()) == {"worker-1": 2, "worker-0": 4, "10.0.0.7": 1}
    assert list(parse_hostfile(text.splitlines())) == ["worker-1", "worker-0", "10.0.0.7"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=1\nb slot=2\n", "hf:2: expected 'HOST slots=N'"),
        ("a slots=1\nb\n", "hf:2: expected 'HOST slots=N' (e.g. 'worker-0 slots=8'), got 'b'"),
        ("a slots=1\nb slots=x\n", "hf:2: expected"),
        ("a slots=1\nb slots=1\na slots=3\n", "hf:3: host 'a' is listed again (first on line 1)"),
        ("a slots=0\n", "hf:1: host 'a' has slots=0; need >= 1"),
        ("# nothing\n\n", "hf lists no hosts"),
    ],
)
def test_bad_hostfile_names_the_line(text: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_hostfile(text.splitlines(), source="hf")


def test_read_hostfile(tmp_path: Path) -> None:
    assert read_hostfile(tmp_path / "missing") is None
    (tmp_path / "hostfile").write_text("w0 slots=2\nw1 slot=2\n")
    with pytest.raises(LaunchError, match=f"{tmp_path}/hostfile:2"):
        read_hostfile(tmp_path / "hostfile")


# --- include / exclude ----------------------------------------------------------------------

POOL = {"worker-0": 4, "worker-1": 4}


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        ("", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
        ("worker-1:0,3", "", {"worker-1": [0, 3]}),
        ("worker-0@worker-1:0,2", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}),
        ("worker-1:2@worker-0:1,1", "", {"worker-0": [1], "worker-1": [2]}),  # pool order
        ("worker-0:1@worker-0", "", {"worker-0": [0, 1, 2, 3]}),  # alone means all
        ("", "worker-1", {"worker-0": [0, 1, 2, 3]}),
        ("", "worker-0:0,1@worker-1:3", {"worker-0": [2, 3], "worker-1": [0, 1, 2]}),
        ("", "worker-0@worker-1", {}),
    ],
)
def test_include_exclude(include: str, exclude: str, expected: dict[str, list[int]]) -> None:
    assert parse_inclusion_exclusion(POOL, include, exclude) == expected


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        ("worker-0", "worker-1", "mutually exclusive"),
        ("jeff", "", "--include names host 'jeff', which the hostfile does not list"),
        ("", "jeff:0", "--exclude names host 'jeff'"),
        ("worker-1:4", "", r"--include asks for slot\(s\) \[4\] of host 'worker-1'"),
        ("worker-1:a", "", "slot 'a' of host 'worker-1' is not a non-negative integer"),
        ("worker-1:0:1", "", "slot '0:1' of host 'worker-1'"),
        ("worker-0@", "", "empty host name"),
    ],
)
def test_include_exclude_errors(include: str, exclude: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        parse_inclusion_exclusion(POOL, include, exclude)


def test_slot_lists_as_pool() -> None:
    """DeepSpeed's parse_resource_filter takes slot lists: those slots are the ones checked."""
    pool = {"a": [1, 3]}
    assert parse_inclusion_exclusion(pool, include="a:3") == {"a": [3]}
    with pytest.raises(LaunchError, match="which has slots"):
        parse_inclusion_exclusion(pool, include="a:0")


def test_resolve_resources() -> None:
    pool = {"a": 2, "b": 4, "c": 1}
    assert resolve_resources(pool, num_nodes=2) == {"a": [0, 1], "b": [0, 1, 2, 3]}
    # --num_gpus sets every host's slots to 0..N-1, as DeepSpeed's runner does
    assert resolve_resources(pool, num_nodes=2, num_gpus=3) == {"a": [0, 1, 2], "b": [0, 1, 2]}
    with pytest.raises(LaunchError, match="--num_nodes 4: the hostfile lists 3 host"):
        resolve_resources(pool, num_nodes=4)
    with pytest.raises(LaunchError, match="cannot be combined with --include/--exclude"):
        resolve_resources(pool, include="a", num_gpus=1)
    with pytest.raises(LaunchError, match="leaves no slot to run on"):
        resolve_resources(pool, exclude="a@b@c")


def test_world_info_round_trip() -> None:
    info = {"b": [0, 2], "a": [1]}
    encoded = encode_world_info(info)
    assert decode_world_info(encoded) == info
    assert list(decode_world_info(encoded)) == ["b", "a"]
    with pytest.raises(LaunchError, match="not base64 of a JSON object"):
        decode_world_info("!!!")
    with pytest.raises(LaunchError, match="not a non-empty"):
        decode_world_info(encode_world_info({"a": []}))


# --- the commands ---------------------------------------------------------------------------

INFO = encode_world_info({"w0": [0, 1], "w1": [0, 1]})


def test_node_command() -> None:
    rank = RankOptions(module=True, no_local_rank=True, each_rank_log="logs")
    cmd = node_command(INFO, 1, "w0", 29600, "pkg.train", ["--deepspeed", "ds.json"], rank,
                       save_pid=77, log_level="info", python=PY)  # fmt: skip
    assert cmd == [
        PY, "-u", "-m", "zcomm.launch.node", f"--world_info={INFO}", "--node_rank=1",
        "--master_addr=w0", "--master_port=29600", "--module", "--no_local_rank",
        "--enable_each_rank_log=logs", "--save_pid=77", "--log_level=info",
        "pkg.train", "--deepspeed", "ds.json",
    ]  # fmt: skip


def test_torchrun_args() -> None:
    args = torchrun_args(2, 1, 4, "w0", 29600, "train.py", ["--x", "1"])
    assert args == [
        "--nnodes=2", "--node-rank=1", "--nproc-per-node=4", "--master-addr=w0",
        "--master-port=29600", "--max-restarts=0", launch.RANK_SHIM, "--mode=python",
        "--local_rank", "--", "train.py", "--x", "1",
    ]  # fmt: skip
    rank = RankOptions(no_python=True, no_local_rank=True, bind_cores_to_rank=True,
                       each_rank_log="L")  # fmt: skip
    args = torchrun_args(1, 0, 2, "127.0.0.1", 1, "run.sh", [], rank, log_prefix="P")
    assert args[6:] == [
        launch.RANK_SHIM, "--mode=exec", "--log_dir", "L", "--log_prefix", "P",
        "--bind_cores", "all", "--", "run.sh",
    ]  # fmt: skip


def test_pdsh_command() -> None:
    node = node_command(INFO, "%n", "w0", 29600, "train.py", ["--prompt", "I'm 6' tall"],
                        python=PY)  # fmt: skip
    cmd = pdsh_command(["w0", "w1"], node, {"NCCL_DEBUG": "INFO", "X": "64(x2)"}, "/job dir",
                       "-R ssh", "/venv/bin/activate")  # fmt: skip
    assert cmd == [
        "pdsh", "-S", "-f", "1024", "-w", "w0,w1", "-R", "ssh",
        "source /venv/bin/activate;", "export NCCL_DEBUG=INFO;", "export X='64(x2)';",
        "cd '/job dir';", PY, "-u", "-m", "zcomm.launch.node", f"--world_info={INFO}",
        "--node_rank=%n", "--master_addr=w0", "--master_port=29600", "train.py", "--prompt",
        shlex.quote("I'm 6' tall"),
    ]  # fmt: skip
    # what each host's shell runs gives the script its arguments back word for word
    remote = " ".join(cmd[9:])
    assert shlex.split(remote)[-2:] == ["--prompt", "I'm 6' tall"]
    assert pdsh_kill_command(["w0", "w1"], INFO) == [
        "pdsh", "-S", "-f", "1024", "-w", "w0,w1", "pkill", "-f",
        f"'zcomm.launch.node --world_info={INFO}'",
    ]  # fmt: skip


def test_slurm_command() -> None:
    node = node_command(INFO, -1, "w0", 29600, "train.py", ["--a"], python=PY)
    assert slurm_command(["w0", "w1"], node, "--partition gpu") == [
        "srun", "--nodes=2", "--ntasks-per-node=1", "--nodelist=w0,w1", "--partition", "gpu",
        "--export=ALL", PY, "-u", "-m", "zcomm.launch.node", f"--world_info={INFO}",
        "--node_rank=-1", "--master_addr=w0", "--master_port=29600", "train.py", "--a",
    ]  # fmt: skip


def test_select_node_under_slurm() -> None:
    info = {"w0": [0], "w1": [0]}
    assert select_node(info, 1, {}) == 1
    assert select_node(info, -1, {"SLURMD_NODENAME": "w1", "SLURM_NODEID": "0"}) == 1
    assert select_node(info, -1, {"SLURMD_NODENAME": "w1.cluster", "SLURM_NODEID": "0"}) == 0
    with pytest.raises(LaunchError, match="is not one of the hostfile's hosts"):
        select_node(info, -1, {"SLURMD_NODENAME": "x"})
    with pytest.raises(LaunchError, match="--node_rank 2: the world info has 2 node"):
        select_node(info, 2, {})


def test_rank_shim_pieces() -> None:
    assert parse_core_list("0,2-4, 7") == [0, 2, 3, 4, 7]
    with pytest.raises(ValueError, match="is not N or N-M"):
        parse_core_list("1-")
    assert cores_for([0, 1, 2, 3, 4], 1, 2) == [2, 3]
    with pytest.raises(ValueError, match="each rank needs at least one"):
        cores_for([0], 0, 2)
    assert rank_argv("t.py", ["--a"], 1, False, False, PY) == [
        PY,
        "-u",
        "t.py",
        "--local_rank=1",
        "--a",
    ]
    assert rank_argv("m", [], None, True, False, PY) == [PY, "-u", "-m", "m"]
    assert rank_argv("./run.sh", ["x"], 0, False, True, PY) == ["./run.sh", "--local_rank=0", "x"]


def test_env_file(tmp_path: Path) -> None:
    (tmp_path / "env").write_text("# comment\nA=1\n\nB = x=y z\n")
    assert read_env_file(tmp_path / "env") == {"A": "1", "B": "x=y z"}
    (tmp_path / "env").write_text("A=1\nnot a pair\n")
    with pytest.raises(LaunchError, match="env:2: expected KEY=VALUE"):
        read_env_file(tmp_path / "env")


def test_deepspeed_argument_names() -> None:
    args = launch.parse_args(["--num_accelerators", "2", "-H", "hf", "-i", "a:0", "t.py", "--x"])
    assert (args.num_gpus, args.hostfile, args.include) == (2, "hf", "a:0")
    assert (args.user_script, args.user_args) == ("t.py", ["--x"])
    assert args.master_port == 29500
    assert args.launcher == "pdsh"


# --- refusals, through main ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--launcher", "ssh", "t.py"], "--launcher 'ssh': choose one of pdsh, slurm, local"),
        (["--elastic_training", "t.py"], "--elastic_training: zstack's launcher runs a fixed"),
        (["--autotuning", "run", "t.py"], "--autotuning run: zstack has no autotuner"),
        (["--module", "--no_python", "t.py"], "--module and --no_python cannot be used together"),
        (["--num_gpus", "0", "t.py"], "--num_gpus 0: give a count of at least 1"),
        (["-H", "/nonexistent/hf", "t.py"], "--hostfile /nonexistent/hf: no such file"),
        (["--num_nodes", "2", "t.py"], "--num_nodes 2 needs a hostfile"),
    ],
)
def test_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(argv, prog="deepspeed") == 2
    assert message in capsys.readouterr().err
    with pytest.raises(LaunchError, match=message.replace("(", r"\(")):
        launch.main(argv, raise_errors=True)


def test_multi_node_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hf").write_text("localhost slots=1\n10.255.0.9 slots=1\n")
    base = ["-H", str(tmp_path / "hf"), "t.py"]
    with pytest.raises(LaunchError, match=r"\['10.255.0.9'\] is not this machine"):
        launch.main(["--launcher", "local", *base], raise_errors=True)
    with pytest.raises(LaunchError, match=r"--no_ssh needs --node_rank in \[0, 2\)"):
        launch.main(["--no_ssh", *base], raise_errors=True)
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without pdsh or srun
    with pytest.raises(LaunchError, match="--launcher pdsh: pdsh is not installed"):
        launch.main(base, raise_errors=True)
    with pytest.raises(LaunchError, match="--launcher slurm: srun is not on PATH"):
        launch.main(["--launcher", "slurm", *base], raise_errors=True)


# --- real launches ---------------------------------------------------------------------------

RANK_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
       "argv": sys.argv[1:], "cores": sorted(os.sched_getaffinity(0)),
       "omp": os.environ.get("OMP_NUM_THREADS"), "cross": os.environ.get("CROSS_SIZE")}
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "zcomm.launch", "--master_port", str(_free_port()), *argv]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_two_ranks_with_core_binding_and_rank_logs(tmp_path: Path) -> None:
    """``--num_gpus 2`` on CPU: two ranks, each told --local_rank first, with its own share of
    the cores (``--bind_cores_to_rank``) and its own log file (``--enable_each_rank_log``)."""
    (tmp_path / "job.py").write_text(RANK_SCRIPT)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("core binding of two ranks needs two cores")
    proc = _launch(["--num_gpus", "2", "--bind_cores_to_rank", "--enable_each_rank_log",
                    "logs", "job.py", "--flag", "a b"], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = sorted((tmp_path / "logs").glob("*_rank*.log"))
    assert [log.name.rsplit("_", 1)[1] for log in logs] == ["rank0.log", "rank1.log"]
    per_rank = len(cores) // 2
    for rank, log in enumerate(logs):
        line = next(x for x in log.read_text().splitlines() if x.startswith("RESULT "))
        found = json.loads(line[len("RESULT ") :])
        assert found["rank"] == rank
        assert found["world"] == 2
        assert found["sum"] == 3.0
        assert found["argv"] == [f"--local_rank={rank}", "--flag", "a b"]
        assert found["cores"] == cores[per_rank * rank : per_rank * (rank + 1)]
        assert found["omp"] == str(per_rank)
        assert found["cross"] == "1"


def test_no_python_and_a_failing_rank(tmp_path: Path) -> None:
    """``--no_python`` execs the script itself; a rank's exit status is the launch's."""
    script = tmp_path / "run.sh"
    # rank 1 fails once rank 0 has printed (a marker file, at most 20 s): failing first, it
    # could have the agent stop rank 0 before its line was out
    script.write_text(
        "#!/bin/sh\n"
        'echo "RANK=$RANK ARGS=$*"\n'
        'if [ "$RANK" = 1 ]; then\n'
        "  i=0\n"
        '  while [ ! -f rank0.done ] && [ "$i" -lt 400 ]; do sleep 0.05; i=$((i + 1)); done\n'
        "  exit 5\n"
        "fi\n"
        "touch rank0.done\n"
        "exit 0\n"
    )
    script.chmod(0o755)
    proc = _launch(["--num_gpus", "2", "--no_python", "./run.sh", "x"], tmp_path)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "RANK=0 ARGS=--local_rank=0 x" in proc.stdout
    assert "RANK=1 ARGS=--local_rank=1 x" in proc.stdout


def test_two_nodes_started_separately_with_no_ssh(tmp_path: Path) -> None:
    """``--no_ssh --node_rank R`` on each node (Accelerate's "nossh" launcher): the same
    command on two "nodes" of this machine, one torchrun agent each, make one world of 2."""
    (tmp_path / "hostfile").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    script = tmp_path / "run.sh"
    script.write_text(
        '#!/bin/sh\necho "RANK=$RANK WORLD=$WORLD_SIZE NODE=$GROUP_RANK NODES=$GROUP_WORLD_SIZE"\n'
    )
    script.chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = (
        f"-m zcomm.launch -H hostfile --no_ssh --master_addr 127.0.0.1 --master_port {_free_port()}"
    )
    tail = "--no_python --no_local_rank ./run.sh"
    procs = [
        subprocess.Popen(
            [sys.executable, *common.split(), "--node_rank", str(node), *tail.split()],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = [proc.communicate(timeout=300) for proc in procs]
    for node, (proc, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 0, out + err
        assert f"RANK={node} WORLD=2 NODE={node} NODES=2" in out
        assert "--nnodes=2" in err
