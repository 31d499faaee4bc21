"""zcomm.launch's MPI launchers (``--launcher openmpi|mpich|impi|mvapich``): the exact mpirun
commands, the rank shim's reading of each MPI's rank variables, the refusals, and real ranks.

No MPI is installed here, so mpirun itself never runs. The real-process tests start the rank
program of a built command the way mpirun starts it: one process per rank with the variables
that MPI sets for its ranks (Open MPI's ``OMPI_COMM_WORLD_*``, Hydra's ``PMI_RANK`` /
``MPI_LOCALRANKID``) plus the command's own exports (``-x K=V``, ``-genv K V``), read back out
of the command. The last test goes through ``python -m zcomm.launch --launcher openmpi`` with
`MPIRUN_STAND_IN` on PATH: a few lines that do what Open MPI's mpirun does on one machine
with that command (start ``-n`` copies of the program with ``-x``'s variables and Open MPI's
rank variables), so the launcher's own wiring (hostfile, exports, rendezvous) is what runs.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from zcomm import launch
from zcomm.launch import (
    RANK_SHIM,
    LaunchError,
    RankOptions,
    check_mpi_filters,
    impi_command,
    mpi_default_exports,
    mpi_env,
    mpi_rank_program,
    mpich_command,
    mvapich_command,
    mvapich_hostfile_text,
    openmpi_command,
    parse_core_list,
    slots_per_host,
)

PY = "/usr/bin/python3"
POOL = {"worker-0": 2, "worker-1": 2}
PROGRAM = ["PROGRAM", "t.py", "--x"]


# --- the rank program -----------------------------------------------------------------------


def test_rank_program() -> None:
    assert mpi_rank_program("t.py", ["--a", "b c"], python=PY) == [
        PY,
        "-u",
        RANK_SHIM,
        "--mode=python",
        "--mpi",
        "--",
        "t.py",
        "--a",
        "b c",
    ]
    every = RankOptions(
        module=True, no_local_rank=True, each_rank_log="logs", bind_cores_to_rank=True
    )
    assert mpi_rank_program("pkg.train", [], every, log_prefix="P", python=PY) == [
        PY,
        "-u",
        RANK_SHIM,
        "--mode=module",
        "--mpi",
        "--log_dir",
        "logs",
        "--log_prefix",
        "P",
        "--bind_cores",
        "all",
        "--",
        "pkg.train",
    ]
    exec_mode = mpi_rank_program("./run.sh", [], RankOptions(no_python=True), python=PY)
    assert exec_mode[3:5] == ["--mode=exec", "--mpi"]
    assert "--local_rank" not in mpi_rank_program("t.py", [], RankOptions(), python=PY)


# --- the commands ---------------------------------------------------------------------------


def test_openmpi_command() -> None:
    cmd = openmpi_command(POOL, "hf", PROGRAM, {"UCX_TLS": "tcp", "A": "x y"}, "worker-0", 29511)
    assert cmd == [
        "mpirun",
        "-n",
        "4",
        "-hostfile",
        "hf",
        "--mca",
        "btl",
        "^openib",
        "--mca",
        "btl_tcp_if_include",
        "eth0",
        "-x",
        "UCX_TLS=tcp",
        "-x",
        "A=x y",
        "-x",
        "MASTER_ADDR=worker-0",
        "-x",
        "MASTER_PORT=29511",
        *PROGRAM,
    ]
    for nic in ("-mca btl_tcp_if_include eth1", "--mca btl_tcp_if_include eth1"):
        own = openmpi_command(POOL, "hf", PROGRAM, {}, "a", 1, nic)
        assert "eth0" not in own
        assert own[8:11] == nic.split()
    # no hostfile (a --force_multi launch on this machine): the pool as --host
    assert openmpi_command({"a": [0, 1], "b": 1}, None, PROGRAM, {}, "a", 1)[3:5] == [
        "--host",
        "a:2,b:1",
    ]


def test_mpich_and_impi_commands() -> None:
    rendezvous = [
        "-genv",
        "K",
        "v w",
        "-genv",
        "MASTER_ADDR",
        "worker-0",
        "-genv",
        "MASTER_PORT",
        "29511",
        "-genv",
        "WORLD_SIZE",
        "4",
        "-genv",
        "LOCAL_SIZE",
        "2",
    ]
    hosts = ["-hosts", "worker-0,worker-1"]
    mpich = mpich_command(POOL, PROGRAM, {"K": "v w"}, "worker-0", 29511, "-l")
    assert mpich == ["mpirun", "-n", "4", "-ppn", "2", "-l", *rendezvous, *hosts, *PROGRAM]
    impi = impi_command(POOL, PROGRAM, {"K": "v w"}, "worker-0", 29511)
    pin = ["-genv", "I_MPI_PIN", "0"]
    assert impi == ["mpirun", "-ppn", "2", *rendezvous, *pin, *hosts, "-n", "4", *PROGRAM]


def test_mvapich_command() -> None:
    exports = mpi_default_exports("mvapich")
    assert "MV2_USE_CUDA" not in exports
    assert mpi_default_exports("mvapich", cuda=True)["MV2_USE_CUDA"] == "1"
    cmd = mvapich_command(POOL, PROGRAM, {"MV2_SUPPORT_DL": "1"}, "worker-0", 29511, hostfile="h")
    assert cmd == [
        "mpirun",
        "-np",
        "4",
        "-ppn",
        "2",
        "--hostfile",
        "h",
        "-env",
        "MV2_SUPPORT_DL",
        "1",
        "-env",
        "MASTER_ADDR",
        "worker-0",
        "-env",
        "MASTER_PORT",
        "29511",
        *PROGRAM,
    ]
    assert mvapich_hostfile_text(POOL) == "worker-0\nworker-1\n"
    assert mpi_default_exports("openmpi") == {"UCX_TLS": "tcp"}
    assert mpi_default_exports("mpich") == {}


def test_same_slots_on_every_host() -> None:
    assert slots_per_host({"a": [0, 1], "b": 2}, "mpich") == 2
    uneven = {"a": 2, "b": 4}
    for build in (mpich_command, impi_command, mvapich_command):
        with pytest.raises(LaunchError, match=r"the hostfile gives \{'a': 2, 'b': 4\}"):
            build(uneven, PROGRAM, {}, "a", 1)
    # Open MPI places ranks by the hostfile's slots itself
    assert openmpi_command(uneven, "hf", PROGRAM, {}, "a", 1)[2] == "6"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "a"}, "--include/--exclude cannot be used"),
        ({"exclude": "a:0"}, "--include/--exclude cannot be used"),
        ({"num_nodes": 1}, "--num_nodes/--num_gpus cannot be used"),
        ({"num_gpus": 2}, "--num_nodes/--num_gpus cannot be used"),
    ],
)
def test_mpi_refuses_filters(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(LaunchError, match=f"--launcher impi runs every slot.*{message}"):
        check_mpi_filters("impi", **kwargs)  # type: ignore[arg-type]
    check_mpi_filters("impi")


# --- the rank shim's MPI variables ----------------------------------------------------------


@pytest.mark.parametrize(
    "environ",
    [
        {  # Open MPI
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        },
        {  # MVAPICH2
            "MV2_COMM_WORLD_RANK": "3",
            "MV2_COMM_WORLD_SIZE": "4",
            "MV2_COMM_WORLD_LOCAL_RANK": "1",
            "MV2_COMM_WORLD_LOCAL_SIZE": "2",
        },
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
        # PMIx / PALS with the command's -genv WORLD_SIZE and LOCAL_SIZE
        {"PMIX_RANK": "3", "PALS_LOCAL_RANKID": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "2"},
    ],
)
def test_mpi_env(environ: dict[str, str]) -> None:
    assert mpi_env(environ) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "LOCAL_SIZE": "2",
    }


def test_mpi_env_errors() -> None:
    with pytest.raises(ValueError, match="RANK not found; none of OMPI_COMM_WORLD_RANK"):
        mpi_env({"WORLD_SIZE": "2"})
    hydra = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE not found"):
        mpi_env(hydra)
    with pytest.raises(ValueError, match="PMI_RANK='x' is not a count"):
        mpi_env({**hydra, "PMI_RANK": "x", "LOCAL_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK=2 is not below WORLD_SIZE=2"):
        mpi_env({**hydra, "PMI_RANK": "2", "LOCAL_SIZE": "2"})


def test_core_list_rules() -> None:
    """DeepSpeed's --bind_core_list rules: ascending, not overlapping, ranges low-high."""
    assert parse_core_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad, message in [
        ("0,2-6,5-9", "'5-9' overlaps or comes before"),
        ("8,2-6", "'2-6' overlaps or comes before"),
        ("1,6-2", "range '6-2' ends before it starts"),
        ("1,,2", "'' is not N or N-M"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_core_list(bad)


# --- ranks started as mpirun starts them ----------------------------------------------------

RANK_SCRIPT = """
import json, os, sys
import torch, zcomm
zcomm.init_distributed(backend="gloo")
t = torch.tensor([float(zcomm.get_rank() + 1)])
zcomm.all_reduce(t)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS")
out = {"rank": zcomm.get_rank(), "world": zcomm.get_world_size(), "sum": t.item(),
       "argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys},
       "cores": sorted(os.sched_getaffinity(0))}
# one write of the whole line: print() writes the text and the newline apart when unbuffered,
# and the two ranks share the launcher's output, so their lines would mix
sys.stdout.write("RESULT " + json.dumps(out) + "\\n")
sys.stdout.flush()
zcomm.destroy()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exports(cmd: list[str], flag: str) -> dict[str, str]:
    """The variables a command exports with ``flag`` (``-x K=V`` or ``-genv K V``)."""
    out: dict[str, str] = {}
    for i, word in enumerate(cmd):
        if word == flag and flag == "-x":
            key, _, value = cmd[i + 1].partition("=")
            out[key] = value
        elif word == flag:
            out[cmd[i + 1]] = cmd[i + 2]
    return out


def _run_ranks(
    program: list[str], per_rank: list[dict[str, str]], cwd: Path
) -> list[dict[str, object]]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            program, cwd=cwd, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for env in per_rank
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
        lines = [line for line in out.decode().splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(lines[0][len("RESULT ") :]))
    return sorted(results, key=lambda r: int(str(r["rank"])))


def test_openmpi_ranks_form_one_world(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(RANK_SCRIPT)
    program = mpi_rank_program("job.py", ["--prompt", "I'm 6' tall"], python=sys.executable)
    cmd = openmpi_command({"localhost": 2}, None, program, {}, "127.0.0.1", _free_port())
    env = _exports(cmd, "-x")
    assert cmd[-len(program) :] == program
    ranks = [
        {
            **env,
            "OMPI_COMM_WORLD_RANK": str(r),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
        for r in range(2)
    ]
    results = _run_ranks(program, ranks, tmp_path)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 for r in results)
    # DeepSpeed's MPI launchers pass no --local_rank: the script's arguments as given
    assert all(r["argv"] == ["--prompt", "I'm 6' tall"] for r in results)
    assert results[1]["env"] == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "LOCAL_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }


def test_mpich_ranks_with_core_binding_and_logs(tmp_path: Path) -> None:
    """Hydra gives each rank PMI_RANK and MPI_LOCALRANKID; the sizes come from the command's
    ``-genv WORLD_SIZE`` / ``LOCAL_SIZE``. Each rank gets its own core (``--bind_cores``) and
    its own log file."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores to bind two ranks")
    (tmp_path / "job.py").write_text(RANK_SCRIPT)
    rank = RankOptions(each_rank_log=str(tmp_path / "logs"), bind_cores_to_rank=True)
    (tmp_path / "logs").mkdir()
    program = mpi_rank_program("job.py", [], rank, log_prefix="run", python=sys.executable)
    cmd = mpich_command({"localhost": 2}, program, {}, "127.0.0.1", _free_port())
    env = _exports(cmd, "-genv")
    assert (env["WORLD_SIZE"], env["LOCAL_SIZE"]) == ("2", "2")
    ranks = [{**env, "PMI_RANK": str(r), "MPI_LOCALRANKID": str(r)} for r in range(2)]
    procs = [
        subprocess.Popen(program, cwd=tmp_path, env={**os.environ, **e, "OMP_NUM_THREADS": "9"})
        for e in ranks
    ]
    assert [proc.wait(timeout=300) for proc in procs] == [0, 0]
    results = []
    for r in range(2):
        text = (tmp_path / "logs" / f"run_rank{r}.log").read_text()
        line = next(x for x in text.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    assert [r["sum"] for r in results] == [3.0, 3.0]
    per_rank = len(cores) // 2
    assert [r["cores"] for r in results] == [cores[:per_rank], cores[per_rank : 2 * per_rank]]
    assert all(r["env"]["OMP_NUM_THREADS"] == str(per_rank) for r in results)


def test_rank_shim_outside_mpi_names_the_variables(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "MV2_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE"):
        env.pop(key, None)
    program = mpi_rank_program("job.py", [], python=sys.executable)
    proc = subprocess.run(program, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "RANK not found; none of OMPI_COMM_WORLD_RANK" in proc.stderr
    assert "is this process started by mpirun?" in proc.stderr


# --- through the launcher -------------------------------------------------------------------

# Open MPI's mpirun as far as this launch needs it on one machine: -n copies of the program
# (which starts at this Python), each with -x's variables and Open MPI's rank variables. It
# writes the command it was given, for the test to compare with openmpi_command's.
MPIRUN_STAND_IN = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
open(os.environ["MPIRUN_ARGV_FILE"], "w").write(json.dumps(args))
start = args.index({python!r})
n = int(args[args.index("-n") + 1])
env = dict(os.environ)
env.update(dict(args[i + 1].split("=", 1) for i in range(start) if args[i] == "-x"))
procs = []
for r in range(n):
    rank_env = dict(env, OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE=str(n),
                    OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE=str(n))
    procs.append(subprocess.Popen(args[start:], env=rank_env))
sys.exit(max(p.wait() for p in procs))
"""


def test_launcher_openmpi_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(RANK_SCRIPT)
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    (tmp_path / "bin").mkdir()
    mpirun = tmp_path / "bin" / "mpirun"
    mpirun.write_text(MPIRUN_STAND_IN.format(python=sys.executable))
    mpirun.chmod(mpirun.stat().st_mode | stat.S_IXUSR)
    port = _free_port()
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "MPIRUN_ARGV_FILE": str(tmp_path / "argv.json"),
        "OMP_NUM_THREADS": "1",
        "NCCL_DEBUG": "WARN",  # carried by name prefix, as DeepSpeed's EXPORT_ENVS
    }
    argv = ["-H", "hostfile", "--force_multi", "--launcher", "openmpi"]
    argv += ["--master_port", str(port), "job.py", "--flag"]
    proc = subprocess.run(
        [sys.executable, "-m", "zcomm.launch", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [
        json.loads(line[len("RESULT ") :])
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["sum"] == 3.0 and r["argv"] == ["--flag"] for r in results)
    given = json.loads((tmp_path / "argv.json").read_text())
    assert given[:10] == [
        "-n",
        "2",
        "-hostfile",
        "hostfile",
        "--mca",
        "btl",
        "^openib",
        "--mca",
        "btl_tcp_if_include",
        "eth0",
    ]
    exported = [given[i + 1] for i, word in enumerate(given) if word == "-x"]
    for pair in ("UCX_TLS=tcp", "NCCL_DEBUG=WARN", "MASTER_ADDR=localhost", f"MASTER_PORT={port}"):
        assert pair in exported
    assert any(pair.startswith(f"PYTHONPATH={tmp_path}") for pair in exported)
    assert given[-8:] == mpi_rank_program("job.py", ["--flag"], python=sys.executable)


def test_launcher_mpi_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hf").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    base = ["-H", str(tmp_path / "hf")]
    # a filter that would leave one host is refused too: it would drop the MPI launcher
    with pytest.raises(LaunchError, match="--launcher mpich runs every slot"):
        launch.main([*base, "--launcher", "mpich", "-i", "worker-0", "t.py"], raise_errors=True)
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without mpirun
    with pytest.raises(LaunchError, match="--launcher mvapich: mpirun is not on PATH"):
        launch.main([*base, "--launcher", "mvapich", "t.py"], raise_errors=True)
