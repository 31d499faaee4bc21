"""``deepspeed.launcher.multinode_runner``, ``deepspeed.launcher.constants`` and
``deepspeed.utils.numa``: DeepSpeed's class and function names with its signatures, whose
commands are zcomm.launch's (compared word for word), DeepSpeed's export quoting, the
refusals. DeepSpeed's own tests of these (launcher/test_multinode_runner.py,
launcher/test_ds_arguments.py) run as the seeds test_seed_launcher_*.py."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest

from deepspeed.launcher import constants, multinode_runner
from deepspeed.launcher.runner import encode_world_info, main, parse_args
from deepspeed.utils import numa
from zcomm.launch import (
    MVAPICH_HOSTFILE,
    RankOptions,
    mpi_rank_program,
    mpich_command,
    node_command,
    openmpi_command,
    pdsh_command,
    pdsh_kill_command,
    slurm_command,
)

POOL = {"worker-0": 2, "worker-1": 2}
WORLD = encode_world_info({"worker-0": [0, 1], "worker-1": [0, 1]})


def _args(*flags: str) -> object:
    return parse_args([*flags, "train.py", "--prompt", "I'm 6' tall"])


def test_names_and_signatures() -> None:
    for name in ("PDSHRunner",):
        params = list(inspect.signature(getattr(multinode_runner, name)).parameters)
        assert params == ["args", "world_info_base64"]
    for name in ("OpenMPIRunner", "MPICHRunner", "IMPIRunner", "SlurmRunner", "MVAPICHRunner"):
        params = list(inspect.signature(getattr(multinode_runner, name)).parameters)
        assert params == ["args", "world_info_base64", "resource_pool"], name
        get_cmd = inspect.signature(getattr(multinode_runner, name).get_cmd)
        assert list(get_cmd.parameters) == ["self", "environment", "active_resources"]
    assert inspect.isabstract(multinode_runner.MultiNodeRunner)
    assert constants.MVAPICH_TMP_HOSTFILE == "/tmp/deepspeed_mvapich_hostfile"
    assert (constants.PDSH_LAUNCHER, constants.PDSH_MAX_FAN_OUT) == ("pdsh", 1024)
    names = {"parse_range", "parse_range_list", "get_numa_cores", "get_numactl_cmd"}
    assert names <= set(numa.__all__)


def test_pdsh_runner_is_zcomms_command() -> None:
    args = _args("--ssh_port", "2222", "--master_addr", "10.0.0.1")
    runner = multinode_runner.PDSHRunner(args, WORLD)
    runner.add_export("SLURM_JOB_CPUS_PER_NODE", "64(x2)")
    env = {"PATH": "/bin"}
    cmd, kill, env_out = runner.get_cmd(env, POOL)
    node = node_command(
        WORLD,
        "%n",
        "10.0.0.1",
        29500,
        "train.py",
        ["--prompt", "I'm 6' tall"],
        RankOptions(),
        log_level="info",
    )
    hosts = ["worker-0", "worker-1"]
    exports = {"SLURM_JOB_CPUS_PER_NODE": "64(x2)"}
    assert cmd == pdsh_command(hosts, node, exports, os.path.abspath("."))
    # DeepSpeed's view of the value is quoted for a shell; the command quotes it once
    assert runner.exports["SLURM_JOB_CPUS_PER_NODE"] == '"64(x2)"'
    assert "export SLURM_JOB_CPUS_PER_NODE='64(x2)';" in cmd
    assert kill == pdsh_kill_command(hosts, WORLD)
    assert env_out is env
    assert env["PDSH_RCMD_TYPE"] == "ssh"
    assert env["PDSH_SSH_ARGS_APPEND"].split() == ["-p", "2222"]
    assert runner.name == "pdsh"


def test_mpi_runners_are_zcomms_commands(tmp_path: Path) -> None:
    args = _args("-H", str(tmp_path / "hf"), "--launcher_args=-l")
    program = mpi_rank_program("train.py", ["--prompt", "I'm 6' tall"], RankOptions())
    openmpi = multinode_runner.OpenMPIRunner(args, WORLD, POOL)
    openmpi.add_export("A", "x y")
    # no such hostfile: the pool as --host; the value goes as one word, unquoted (no shell)
    assert openmpi.get_cmd({}, POOL) == openmpi_command(
        POOL, None, program, {"UCX_TLS": "tcp", "A": "x y"}, "worker-0", 29500, "-l"
    )
    assert openmpi.exports == {"UCX_TLS": "tcp", "A": '"x y"'}
    (tmp_path / "hf").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    assert openmpi.get_cmd({}, POOL)[3:5] == ["-hostfile", str(tmp_path / "hf")]
    mpich = multinode_runner.MPICHRunner(args, WORLD, POOL)
    assert mpich.get_cmd({}, POOL) == mpich_command(POOL, program, {}, "worker-0", 29500, "-l")
    impi = multinode_runner.IMPIRunner(args, WORLD, POOL).get_cmd({}, POOL)
    assert impi[:4] == ["mpirun", "-ppn", "2", "-l"]
    assert impi[-len(program) - 2 :] == ["-n", "4", *program]
    mvapich = multinode_runner.MVAPICHRunner(args, WORLD, POOL)
    assert mvapich.exports["MV2_SUPPORT_DL"] == "1"
    assert mvapich.get_cmd({}, POOL)[:7] == [
        "mpirun",
        "-np",
        "4",
        "-ppn",
        "2",
        "--hostfile",
        MVAPICH_HOSTFILE,
    ]
    assert Path(MVAPICH_HOSTFILE).read_text() == "worker-0\nworker-1\n"
    names = [r.name for r in (openmpi, mpich, mvapich)]
    assert names == ["openmpi", "mpich", "mvapich"]


def test_slurm_runner_is_zcomms_command() -> None:
    runner = multinode_runner.SlurmRunner(_args(), WORLD, POOL)
    runner.add_export("NCCL_DEBUG", "INFO")
    env: dict[str, str] = {}
    cmd = runner.get_cmd(env, {"worker-1": [0, 1]})  # the hosts left after a filter
    node = node_command(
        WORLD,
        -1,
        "worker-1",
        29500,
        "train.py",
        ["--prompt", "I'm 6' tall"],
        log_level="info",
    )
    assert cmd == slurm_command(["worker-1"], node)
    assert env == {"NCCL_DEBUG": "INFO"}  # srun --export=ALL carries it


@pytest.mark.parametrize("cls", ["OpenMPIRunner", "MPICHRunner", "IMPIRunner", "MVAPICHRunner"])
@pytest.mark.parametrize(
    "flags", [("--include", "worker-0"), ("--exclude", "worker-1:0"), ("--num_gpus", "1")]
)
def test_mpi_runners_refuse_filters(cls: str, flags: tuple[str, str]) -> None:
    with pytest.raises(ValueError, match="runs every slot of the hostfile"):
        getattr(multinode_runner, cls)(_args(*flags), WORLD, POOL)


def test_backend_exists_looks_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    runners = [multinode_runner.PDSHRunner(_args(), WORLD)]
    for cls in ("OpenMPIRunner", "MPICHRunner", "IMPIRunner", "SlurmRunner", "MVAPICHRunner"):
        runners.append(getattr(multinode_runner, cls)(_args(), WORLD, POOL))
    assert [r.backend_exists() for r in runners] == [False] * 6
    (tmp_path / "mpirun").write_text("#!/bin/sh\n")
    (tmp_path / "mpirun").chmod(0o755)
    assert runners[2].backend_exists()


def test_deepspeed_launcher_mpi_without_mpirun(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "hf").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="--launcher openmpi: mpirun is not on PATH"):
        main(["-H", str(tmp_path / "hf"), "--launcher", "openmpi", "train.py"])


# --- deepspeed.utils.numa -------------------------------------------------------------------


def test_range_lists() -> None:
    assert numa.parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    assert numa.parse_range("2-4") == range(2, 5)
    assert numa.parse_range("7") == range(7, 8)
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2", "a"):
        with pytest.raises(ValueError, match="--bind_core_list"):
            numa.parse_range_list(bad)
    with pytest.raises(ValueError, match="range '5-3' ends before it starts"):
        numa.parse_range("5-3")


def test_numactl_cmd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    per_rank, cmd = numa.get_numactl_cmd("0-3,8,10-11", 3, 2)
    assert per_rank == 2
    assert cmd[0] == "numactl"
    assert cmd[-2:] == ["-C", "8,10"]  # 7 cores, 2 each: rank 2 has the 5th and 6th
    every = numa.get_numactl_cmd("0-3,8,10-11", 1, 0)
    assert (every[0], every[1][-2:]) == (7, ["-C", "0-3,8,10-11"])
    assert numa.get_numactl_cmd("0-5", 2, 1)[1][-2:] == ["-C", "3-5"]
    # the rank's cores all on one NUMA node: its memory there too
    nodes = numa.get_numa_cores()
    mine = sorted(os.sched_getaffinity(0))
    per_rank, cmd = numa.get_numactl_cmd(None, 1, 0)
    assert per_rank == len(mine)
    if sys.platform == "linux" and nodes:
        holding = [i for i, cores in enumerate(nodes) if set(mine) <= set(cores)]
        assert (cmd[1:3] == ["-m", str(holding[0])]) if holding else cmd[1] == "-C"
    with pytest.raises(ValueError, match="each rank needs at least one"):
        numa.get_numactl_cmd("0", 2, 0)
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    with pytest.raises(ValueError, match="KMP_AFFINITY is set"):
        numa.get_numactl_cmd("0-3", 2, 0)
