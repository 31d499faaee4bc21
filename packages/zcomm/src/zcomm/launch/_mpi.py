"""The commands of the MPI launchers (``--launcher openmpi|mpich|impi|mvapich``), as exact
argument lists (pure functions, tested as such; mpirun itself is not run here).

DeepSpeed's shape for each: ``mpirun`` with the process count, the hosts, the launcher's
options, ``--launcher_args``, the exported variables in that MPI's own syntax, then one program
that every rank runs. Where DeepSpeed's rank program is ``python -u SCRIPT`` (its ranks find
their rank through mpi4py), zstack's is the rank shim with ``--mpi`` (`mpi_rank_program`): it
sets torch's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` from the MPI launcher's
variables, then execs the script, so the script, zcomm, Accelerate and torch.distributed all
start as under torchrun. The rendezvous is ``MASTER_ADDR:MASTER_PORT`` (the first host), which
every command exports. As DeepSpeed's MPI launchers, the script gets no ``--local_rank``
argument (``LOCAL_RANK`` is in its environment).

Exports go as separate words (``-x K=V``, ``-genv K V``, ``-env K V``), never through a shell,
so values need no quoting.
"""

from __future__ import annotations

import itertools
import shlex
import sys
from collections.abc import Mapping, Sequence

from zcomm.launch._commands import RANK_SHIM, RankOptions
from zcomm.launch._hostfile import LaunchError

__all__ = [
    "MPI_LAUNCHERS",
    "MVAPICH_HOSTFILE",
    "check_mpi_filters",
    "impi_command",
    "mpi_default_exports",
    "mpi_rank_program",
    "mpich_command",
    "mvapich_command",
    "mvapich_hostfile_text",
    "openmpi_command",
    "slots_per_host",
]

MPI_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich")
MVAPICH_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"  # DeepSpeed's: one host name a line
# Open MPI's default TCP interface, unless --launcher_args names one (DeepSpeed's)
OPENMPI_DEFAULT_NIC = "eth0"


def check_mpi_filters(
    launcher: str, include: str = "", exclude: str = "", num_nodes: int = -1, num_gpus: int = -1
) -> None:
    """The MPI launchers run every slot of the hostfile (mpirun places the ranks), so a
    filter is refused with `LaunchError`, as DeepSpeed's MPI runners refuse it."""
    if include or exclude:
        raise LaunchError(
            f"--launcher {launcher} runs every slot of the hostfile: --include/--exclude cannot "
            "be used with it (edit the hostfile, or use --launcher pdsh or slurm)"
        )
    if num_nodes != -1 or num_gpus != -1:
        raise LaunchError(
            f"--launcher {launcher} runs every slot of the hostfile: --num_nodes/--num_gpus "
            "cannot be used with it (edit the hostfile's hosts and slots=N)"
        )


def mpi_default_exports(launcher: str, cuda: bool = False) -> dict[str, str]:
    """The variables DeepSpeed's runner for ``launcher`` always exports: UCX over TCP for Open
    MPI; MVAPICH2's settings for deep learning (no CMA, no affinity, CUDA-aware on CUDA)."""
    if launcher == "openmpi":
        return {"UCX_TLS": "tcp"}
    if launcher == "mvapich":
        out = {"MV2_SMP_USE_CMA": "0", "MV2_DEBUG_SHOW_BACKTRACE": "1"}
        if cuda:
            out["MV2_USE_CUDA"] = "1"
        out.update(
            {
                "MV2_SUPPORT_DL": "1",
                "MV2_ENABLE_AFFINITY": "0",
                "MV2_INTER_ALLGATHER_TUNING": "5",
                "MV2_CUDA_USE_NAIVE": "0",
            }
        )
        return out
    return {}


def mpi_rank_program(
    script: str,
    script_args: Sequence[str] = (),
    rank: RankOptions | None = None,
    *,
    log_prefix: str = "",
    python: str | None = None,
) -> list[str]:
    """What each MPI rank runs: the rank shim with ``--mpi`` (``python``, ``-m`` or the script
    itself by ``rank``'s mode; each-rank logs and core binding as under torchrun), then the
    script. ``rank.no_local_rank`` changes nothing: MPI ranks get no ``--local_rank``."""
    rank = rank or RankOptions()
    mode = "module" if rank.module else "exec" if rank.no_python else "python"
    shim = [f"--mode={mode}", "--mpi"]
    if rank.each_rank_log is not None:
        shim += ["--log_dir", rank.each_rank_log, "--log_prefix", log_prefix]
    if rank.bind_cores_to_rank:
        shim += ["--bind_cores", rank.bind_core_list or "all"]
    return [python or sys.executable, "-u", RANK_SHIM, *shim, "--", script, *script_args]


def slots_per_host(pool: Mapping[str, int | Sequence[int]], launcher: str) -> int:
    """The one rank count every host runs (``-ppn``): MPICH, Intel MPI and MVAPICH place the
    same number on each, so hosts with different counts raise `LaunchError`."""
    counts = {host: n if isinstance(n, int) else len(n) for host, n in pool.items()}
    if not counts:
        raise LaunchError(f"--launcher {launcher}: no hosts to run on")
    if len(set(counts.values())) != 1:
        raise LaunchError(
            f"--launcher {launcher} runs the same number of ranks on every host, but the "
            f"hostfile gives {counts}; give each host the same slots=N"
        )
    return next(iter(counts.values()))


def _total(pool: Mapping[str, int | Sequence[int]]) -> int:
    return sum(n if isinstance(n, int) else len(n) for n in pool.values())


def _names_nic(launcher_args: Sequence[str]) -> bool:
    return any(
        flag in ("-mca", "--mca") and name == "btl_tcp_if_include"
        for flag, name in itertools.pairwise(launcher_args)
    )


def openmpi_command(
    pool: Mapping[str, int | Sequence[int]],
    hostfile: str | None,
    program: Sequence[str],
    exports: Mapping[str, str],
    master_addr: str,
    master_port: int,
    launcher_args: str = "",
) -> list[str]:
    """Open MPI's ``mpirun``: every slot of ``hostfile`` (``HOST slots=N`` is Open MPI's own
    format; without one, ``--host a:N,b:M`` from ``pool``), openib off, TCP on eth0 unless
    ``launcher_args`` names the interface (``--mca btl_tcp_if_include IF``), each export as
    ``-x K=V``."""
    extra = shlex.split(launcher_args)
    nic = [] if _names_nic(extra) else ["--mca", "btl_tcp_if_include", OPENMPI_DEFAULT_NIC]
    env = {**exports, "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
    if hostfile is None:
        counts = {host: n if isinstance(n, int) else len(n) for host, n in pool.items()}
        where = ["--host", ",".join(f"{host}:{n}" for host, n in counts.items())]
    else:
        where = ["-hostfile", hostfile]
    cmd = ["mpirun", "-n", str(_total(pool)), *where, "--mca", "btl", "^openib", *nic, *extra]
    for key, value in env.items():
        cmd += ["-x", f"{key}={value}"]
    return [*cmd, *program]


def _hydra_env(
    flag: str,
    exports: Mapping[str, str],
    master_addr: str,
    master_port: int,
    total: int,
    per_host: int,
) -> list[str]:
    env = {
        **exports,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(total),
        "LOCAL_SIZE": str(per_host),
    }
    out: list[str] = []
    for key, value in env.items():
        out += [flag, key, value]
    return out


def mpich_command(
    pool: Mapping[str, int | Sequence[int]],
    program: Sequence[str],
    exports: Mapping[str, str],
    master_addr: str,
    master_port: int,
    launcher_args: str = "",
) -> list[str]:
    """MPICH's (Hydra's) ``mpirun -n TOTAL -ppn PER_HOST``, each export and the rendezvous,
    ``WORLD_SIZE`` and ``LOCAL_SIZE`` as ``-genv K V``, the hosts as ``-hosts a,b``."""
    per_host = slots_per_host(pool, "mpich")
    total = _total(pool)
    cmd = ["mpirun", "-n", str(total), "-ppn", str(per_host), *shlex.split(launcher_args)]
    cmd += _hydra_env("-genv", exports, master_addr, master_port, total, per_host)
    return [*cmd, "-hosts", ",".join(pool), *program]


def impi_command(
    pool: Mapping[str, int | Sequence[int]],
    program: Sequence[str],
    exports: Mapping[str, str],
    master_addr: str,
    master_port: int,
    launcher_args: str = "",
) -> list[str]:
    """Intel MPI's ``mpirun -ppn PER_HOST``: as MPICH's, with Intel MPI's own pinning off
    (``I_MPI_PIN 0``: ``--bind_cores_to_rank`` binds through the rank shim, as DeepSpeed
    binds through numactl), then ``-n TOTAL`` and the program."""
    per_host = slots_per_host(pool, "impi")
    total = _total(pool)
    cmd = ["mpirun", "-ppn", str(per_host), *shlex.split(launcher_args)]
    cmd += _hydra_env("-genv", exports, master_addr, master_port, total, per_host)
    cmd += ["-genv", "I_MPI_PIN", "0"]
    return [*cmd, "-hosts", ",".join(pool), "-n", str(total), *program]


def mvapich_hostfile_text(pool: Mapping[str, int | Sequence[int]]) -> str:
    """The host file MVAPICH's ``mpirun --hostfile`` reads: one host name a line."""
    return "".join(f"{host}\n" for host in pool)


def mvapich_command(
    pool: Mapping[str, int | Sequence[int]],
    program: Sequence[str],
    exports: Mapping[str, str],
    master_addr: str,
    master_port: int,
    launcher_args: str = "",
    hostfile: str = MVAPICH_HOSTFILE,
) -> list[str]:
    """MVAPICH2's ``mpirun -np TOTAL -ppn PER_HOST --hostfile F`` (``F`` holds
    `mvapich_hostfile_text`), each export and the rendezvous as ``-env K V``."""
    per_host = slots_per_host(pool, "mvapich")
    cmd = ["mpirun", "-np", str(_total(pool)), "-ppn", str(per_host), "--hostfile", hostfile]
    cmd += shlex.split(launcher_args)
    env = {**exports, "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
    for key, value in env.items():
        cmd += ["-env", key, value]
    return [*cmd, *program]
