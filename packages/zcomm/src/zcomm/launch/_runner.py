"""The launcher: DeepSpeed's ``deepspeed`` command line, run through torchrun on each node.

`main` reads the hostfile, applies ``--include``/``--exclude``/``--num_nodes``/``--num_gpus``
as DeepSpeed's runner does, and runs the node command (`node_command`) on each node: in this
process for one node (or one node of a ``--no_ssh`` launch), through pdsh or srun for several,
or as local processes with ``--launcher local`` (zstack's: every host of the hostfile is this
machine, for trying a multi-node launch on one). With an MPI launcher (``openmpi``, ``mpich``,
``impi``, ``mvapich``) several nodes run under one ``mpirun`` instead, without torchrun
(`zcomm.launch._mpi`).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType

from zcomm.launch import _node
from zcomm.launch._args import parse_args, refuse
from zcomm.launch._commands import (
    RankOptions,
    node_command,
    pdsh_command,
    pdsh_environment,
    pdsh_kill_command,
    slurm_command,
)
from zcomm.launch._hostfile import (
    DLTS_HOSTFILE,
    LaunchError,
    encode_world_info,
    parse_inclusion_exclusion,
    read_hostfile,
)
from zcomm.launch._mpi import (
    MPI_LAUNCHERS,
    MVAPICH_HOSTFILE,
    check_mpi_filters,
    impi_command,
    mpi_default_exports,
    mpi_rank_program,
    mpich_command,
    mvapich_command,
    mvapich_hostfile_text,
    openmpi_command,
)

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "EXPORT_ENVS",
    "local_slots",
    "main",
    "read_env_file",
    "resolve_resources",
]

_log = logging.getLogger("zcomm.launch")

# The file of extra variables exported to every node (Accelerate's multi-node launch writes it)
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
# Variables carried to the other nodes by name prefix, as DeepSpeed's runner does
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "DLTS_", "NEBULA_", "AML_", "AZUREML_"]
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


def local_slots(environ: Mapping[str, str] | None = None) -> int:
    """This machine's ranks when no hostfile or ``--num_gpus`` says: its CUDA devices, or 1
    on a machine without CUDA (a CPU run asks for more with ``--num_gpus N``)."""
    import torch  # after parsing, so --help stays quick

    env = os.environ if environ is None else environ
    if env.get("ZCOMM_ACCELERATOR", "") != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def resolve_resources(
    pool: Mapping[str, int],
    include: str = "",
    exclude: str = "",
    num_nodes: int = -1,
    num_gpus: int = -1,
) -> dict[str, list[int]]:
    """The slots each host runs, in the pool's order, as DeepSpeed's runner works them out:
    the filters, then the first ``num_nodes`` hosts, then slots 0..``num_gpus``-1 on each."""
    if (num_nodes > 0 or num_gpus > 0) and (include or exclude):
        raise LaunchError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    active = parse_inclusion_exclusion(pool, include, exclude)
    if not active:
        raise LaunchError(f"--exclude {exclude!r} leaves no slot to run on")
    if num_nodes > 0:
        if num_nodes > len(active):
            raise LaunchError(
                f"--num_nodes {num_nodes}: the hostfile lists {len(active)} host(s) "
                f"({', '.join(active)})"
            )
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        active = {host: list(range(num_gpus)) for host in active}
    return active


def read_env_file(path: str | Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of a ``.deepspeed_env`` file; blank lines and ``#`` comments are
    skipped, a line without ``=`` raises `LaunchError` naming it."""
    out: dict[str, str] = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip():
            raise LaunchError(f"{path}:{number}: expected KEY=VALUE, got {raw!r}")
        out[key.strip()] = value.strip()
    return out


def _exports(environ: Mapping[str, str]) -> dict[str, str]:
    """What every node gets: this directory on PYTHONPATH, the variables DeepSpeed carries by
    prefix, and the .deepspeed_env files (home, then here)."""
    out = {
        key: value
        for key, value in environ.items()
        if any(key.startswith(prefix) for prefix in EXPORT_ENVS)
    }
    here = os.path.abspath(".")
    out["PYTHONPATH"] = f"{here}:{environ['PYTHONPATH']}" if environ.get("PYTHONPATH") else here
    for folder in DEEPSPEED_ENVIRONMENT_PATHS:
        file = Path(folder, DEEPSPEED_ENVIRONMENT_NAME)
        if file.is_file():
            _log.info("exporting %s", file)
            out.update(read_env_file(file))
    return out


def _is_local(host: str) -> bool:
    if host in _LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address.startswith("127.") or address == socket.gethostbyname(socket.gethostname())


def _wait_all(procs: list[subprocess.Popen[bytes]]) -> int:
    """Wait for the node processes; when one fails, stop the others. The first failure's
    status (DeepSpeed's launcher exits with the failed rank's)."""
    status = 0

    def stop(signum: int, frame: FrameType | None) -> None:
        del frame
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        alive = list(procs)
        while alive:
            for proc in list(alive):
                try:
                    code = proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                alive.remove(proc)
                if code != 0 and status == 0:
                    status = code if code > 0 else 1
                    _log.error(
                        "node process %d exited with %d; stopping the others", proc.pid, code
                    )
                    for other in alive:
                        other.terminate()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


def _local_pool(args: argparse.Namespace, hostfile: str) -> dict[str, int]:
    """This machine as the only host, with no hostfile: its CUDA devices (or 1 rank on CPU),
    ``CUDA_VISIBLE_DEVICES``'s ids taken as ``--include localhost:IDS`` as DeepSpeed does."""
    _log.info("no hostfile at %s: running on this machine only", hostfile)
    count = local_slots()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = visible.split(",") if visible else []
    if ids and all(i.strip().isdigit() for i in ids):
        if args.include or args.exclude or args.num_nodes > 1 or args.num_gpus > 0:
            _log.info("ignoring CUDA_VISIBLE_DEVICES=%s: slots given on the command line", visible)
        else:
            args.include = f"localhost:{visible}"
            _log.info("CUDA_VISIBLE_DEVICES=%s: --include %s", visible, args.include)
            # the ids are the machine's device numbers; torch counts only the visible ones
            count = max(count, *(int(i) + 1 for i in ids))
        del os.environ["CUDA_VISIBLE_DEVICES"]  # each node sets its own from its slots
    if args.num_nodes > 1:
        raise LaunchError(
            f"--num_nodes {args.num_nodes} needs a hostfile listing the hosts (none at {hostfile})"
        )
    if args.num_gpus < 0 and not args.include:
        _log.info("%d rank(s) on this machine (--num_gpus N for another count)", count)
    args.master_addr = args.master_addr or "127.0.0.1"
    return {"localhost": count}


def _check_ssh(host: str, port: int | None) -> None:
    """pdsh needs passwordless ssh: try it on the first host, as DeepSpeed's runner does."""
    check = ["ssh", "-o", "PasswordAuthentication=no", *(["-p", str(port)] if port else [])]
    quiet = subprocess.DEVNULL
    if subprocess.call([*check, host, "hostname"], stdout=quiet, stderr=quiet) != 0:
        raise LaunchError(
            f"host {host} is not reachable with passwordless ssh; set it up, or remove the "
            "hostfile to run on this machine only (--no_ssh_check skips this check)"
        )


def _mpi_command(
    args: argparse.Namespace,
    active: dict[str, list[int]],
    hostfile: str,
    rank: RankOptions,
    exports: dict[str, str],
) -> list[str]:
    """One ``mpirun`` for every rank of every host (``--launcher openmpi|mpich|impi|mvapich``)."""
    launcher = args.launcher.lower()
    if shutil.which("mpirun") is None:
        raise LaunchError(
            f"--launcher {launcher}: mpirun is not on PATH; install {launcher}'s MPI, or use "
            "--launcher pdsh or slurm (torchrun on each node)"
        )
    import torch  # after parsing, so --help stays quick

    env_out = {**mpi_default_exports(launcher, torch.cuda.is_available()), **exports}
    program = mpi_rank_program(
        args.user_script, args.user_args, rank, log_prefix=time.strftime("%Y%m%d%H%M%S")
    )
    where = (args.master_addr, args.master_port, args.launcher_args)
    if launcher == "openmpi":
        given = hostfile if Path(hostfile).is_file() else None  # else --host from the pool
        return openmpi_command(active, given, program, env_out, *where)
    if launcher == "mpich":
        return mpich_command(active, program, env_out, *where)
    if launcher == "impi":
        return impi_command(active, program, env_out, *where)
    command = mvapich_command(active, program, env_out, *where)  # checks the slots first
    Path(MVAPICH_HOSTFILE).write_text(mvapich_hostfile_text(active))
    return command


def _run_remote(
    args: argparse.Namespace,
    hosts: list[str],
    world_info: str,
    cmd: Callable[[int | str], list[str]],
    env: dict[str, str],
    exports: dict[str, str],
) -> int:
    """The node commands through pdsh (``--node_rank=%n``) or srun (each node finds itself)."""
    if args.launcher.lower() == "pdsh":
        if shutil.which("pdsh") is None:
            raise LaunchError(
                "--launcher pdsh: pdsh is not installed (not on PATH); install it, or use "
                "--launcher slurm, or --launcher local when every host is this machine"
            )
        if not args.no_ssh_check:
            _check_ssh(hosts[0], args.ssh_port)
        env = pdsh_environment(env, args.ssh_port)
        full = pdsh_command(
            hosts, cmd("%n"), exports, os.path.abspath("."), args.launcher_args, args.venv_script
        )
        kill = pdsh_kill_command(hosts, world_info, args.launcher_args)
    else:  # slurm
        if shutil.which("srun") is None:
            raise LaunchError("--launcher slurm: srun is not on PATH (not inside Slurm?)")
        env.update(exports)
        full = slurm_command(hosts, cmd(-1), args.launcher_args)
        kill = None
    return _run_command(full, env, kill)


def _run_command(full: list[str], env: dict[str, str], kill: list[str] | None) -> int:
    """Run the launcher command (pdsh, srun, mpirun); signals go on to it, and ``kill`` runs
    after an interrupt."""
    _log.info("cmd = %s", " ".join(full))
    proc = subprocess.Popen(full, env=env)

    def interrupted(signum: int, frame: FrameType | None) -> None:
        del frame
        proc.send_signal(signum)
        if kill is not None:
            subprocess.call(kill, env=env)
        sys.exit(1)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    code = proc.wait()
    return code if code > 0 else (1 if code else 0)


def _launch(args: argparse.Namespace) -> int:
    refuse(args)
    launcher = args.launcher.lower()
    hostfile = args.hostfile or DLTS_HOSTFILE
    pool = read_hostfile(hostfile)
    if pool is None and args.hostfile is not None:
        raise LaunchError(f"--hostfile {args.hostfile}: no such file")
    if pool is None:
        pool = _local_pool(args, hostfile)
    if launcher in MPI_LAUNCHERS and (args.force_multi or len(pool) > 1) and not args.no_ssh:
        # before the filters narrow the hosts: one host left would run here, without mpirun
        check_mpi_filters(launcher, args.include, args.exclude, args.num_nodes, args.num_gpus)
    active = resolve_resources(pool, args.include, args.exclude, args.num_nodes, args.num_gpus)
    hosts = list(active)
    if args.no_ssh and not 0 <= args.node_rank < len(hosts):
        raise LaunchError(
            f"--no_ssh needs --node_rank in [0, {len(hosts)}) for this node, got {args.node_rank}"
        )
    multi = (args.force_multi or len(hosts) > 1) and not args.no_ssh
    if not args.master_addr:
        args.master_addr = hosts[0] if (multi or args.no_ssh) else "127.0.0.1"
        _log.info("--master_addr %s", args.master_addr)
    world_info = encode_world_info(active)
    rank = RankOptions(
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        each_rank_log=None if args.enable_each_rank_log == "None" else args.enable_each_rank_log,
        bind_cores_to_rank=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
    )
    log_level = "error" if args.quiet else args.log_level
    save_pid = os.getpid() if args.save_pid else None

    def cmd(node_rank: int | str) -> list[str]:
        return node_command(
            world_info,
            node_rank,
            args.master_addr,
            args.master_port,
            args.user_script,
            args.user_args,
            rank,
            save_pid=save_pid,
            log_level=log_level,
        )

    if not multi:
        node_rank = args.node_rank if args.no_ssh else 0
        _log.info("cmd = %s", " ".join(cmd(node_rank)))
        # this process is the node launcher (DeepSpeed starts a second python for it)
        return _node.main(cmd(node_rank)[4:])

    env = dict(os.environ)
    exports = _exports(env)
    if launcher == "local":
        not_here = [host for host in hosts if not _is_local(host)]
        if not_here:
            raise LaunchError(
                f"--launcher local runs every node on this machine, but {not_here} "
                "is not this machine; use pdsh or slurm"
            )
        env.update(exports)
        procs = []
        for index in range(len(hosts)):
            _log.info("node %d: %s", index, " ".join(cmd(index)))
            procs.append(subprocess.Popen(cmd(index), env=env))
        return _wait_all(procs)
    if launcher in MPI_LAUNCHERS:
        return _run_command(_mpi_command(args, active, hostfile, rank, exports), env, None)
    return _run_remote(args, hosts, world_info, cmd, env, exports)


def main(
    argv: Sequence[str] | None = None, prog: str = "deepspeed", *, raise_errors: bool = False
) -> int:
    """Run DeepSpeed's ``deepspeed`` command line ``argv``; the exit status (0: every rank
    finished; the failed rank's status; 2: the launch was refused, with the reason on stderr,
    or with ``raise_errors`` as the `LaunchError` it is)."""
    args = parse_args(argv, prog)
    logging.basicConfig(format="[zcomm.launch] %(message)s")
    _log.setLevel("ERROR" if args.quiet else args.log_level.upper())
    try:
        return _launch(args)
    except LaunchError as error:
        if raise_errors:
            raise
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
