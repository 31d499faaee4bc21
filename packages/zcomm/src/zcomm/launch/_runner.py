"""The launcher: DeepSpeed's ``deepspeed`` command line, run through torchrun on each node.

`main` reads the hostfile, applies ``--include``/``--exclude``/``--num_nodes``/``--num_gpus``
as DeepSpeed's runner does, and runs the node command (`node_command`) on each node: in this
process for one node (or one node of a ``--no_ssh`` launch), through pdsh or srun for several,
or as local processes with ``--launcher local`` (zstack's: every host of the hostfile is this
machine, for trying a multi-node launch on one).
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from zcomm.launch import _node
from zcomm.launch._commands import (
    RankOptions,
    node_command,
    pdsh_command,
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

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "EXPORT_ENVS",
    "LAUNCHERS",
    "REFUSED_LAUNCHERS",
    "build_parser",
    "local_slots",
    "main",
    "parse_args",
    "read_env_file",
    "resolve_resources",
]

_log = logging.getLogger("zcomm.launch")

DEFAULT_PORT = 29500  # torch.distributed's and DeepSpeed's
# The file of extra variables exported to every node (Accelerate's multi-node launch writes it)
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
# Variables carried to the other nodes by name prefix, as DeepSpeed's runner does
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "DLTS_", "NEBULA_", "AML_", "AZUREML_"]
LAUNCHERS = ("pdsh", "slurm", "local")
REFUSED_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich")
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


def build_parser(prog: str = "deepspeed") -> argparse.ArgumentParser:
    """DeepSpeed's launcher arguments, with its names and defaults."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Launch a training script on this node's or several nodes' slots through "
        "torchrun (DeepSpeed's launcher arguments; zstack).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add(
        "-H",
        "--hostfile",
        default=None,
        help=f"hostfile of 'HOST slots=N' lines (default {DLTS_HOSTFILE} when it exists; "
        "without one, this machine)",
    )
    add(
        "-i",
        "--include",
        default="",
        help="slots to use: NAME[:SLOT[,SLOT...]][@NAME...], e.g. 'worker-0@worker-1:0,2'",
    )
    add(
        "-e",
        "--exclude",
        default="",
        help="slots not to use, same format as --include (exclusive with it)",
    )
    add("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    add(
        "--num_gpus",
        "--num_accelerators",
        type=int,
        default=-1,
        help="ranks per node (slots 0..N-1); on a machine without CUDA, CPU ranks",
    )
    add("--master_port", type=int, default=DEFAULT_PORT, help="the rendezvous port on node 0")
    add(
        "--master_addr",
        default="",
        help="node 0's address (default 127.0.0.1 on one node, else the first host's name)",
    )
    add("--node_rank", type=int, default=-1, help="this node's index, with --no_ssh")
    add(
        "--launcher",
        default="pdsh",
        help="how several nodes are started: pdsh, slurm, or local (zstack: every host is "
        "this machine); openmpi, mpich, impi, mvapich are refused",
    )
    add("--launcher_args", default="", help="arguments for pdsh or srun, one quoted string")
    add("--module", action="store_true", help="run the script as 'python -m'")
    add("--no_python", action="store_true", help="exec the script itself, without python")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    add(
        "--no_ssh",
        action="store_true",
        help="start this node only (--node_rank); run the same command on every node",
    )
    add("--no_ssh_check", action="store_true", help="skip pdsh's ssh check of the first host")
    add("--force_multi", action="store_true", help="use the multi-node launcher even for one host")
    add(
        "--save_pid",
        action="store_true",
        help="each node launcher writes its pid to /tmp/<this pid>.deepspeed",
    )
    add(
        "--enable_each_rank_log",
        default="None",
        help="a folder: each rank's stdout and stderr to its own file there",
    )
    add(
        "--bind_cores_to_rank",
        action="store_true",
        help="give each local rank an equal share of the cores and OMP_NUM_THREADS",
    )
    add("--bind_core_list", default=None, help="the cores to share, e.g. '0-7,16-23'")
    add("--ssh_port", type=int, default=None, help="ssh port for pdsh")
    add("--venv_script", default=None, help="a script sourced on each node first (pdsh)")
    add(
        "--log_level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="launcher log level",
    )
    add("-q", "--quiet", action="store_true", help="same as --log_level error")
    # DeepSpeed's, refused by name (see _refuse)
    add("--autotuning", default="", choices=["", "tune", "run"], help="refused: no autotuner")
    add("--elastic_training", action="store_true", help="refused: use torchrun's elastic mode")
    add("--min_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    add("--max_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    add("user_script", help="the training script (or module with --module)")
    add("user_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def parse_args(argv: Sequence[str] | None = None, prog: str = "deepspeed") -> argparse.Namespace:
    """The launcher's arguments as a namespace with DeepSpeed's attribute names."""
    return build_parser(prog).parse_args(argv)


def _refuse(args: argparse.Namespace) -> None:
    if args.autotuning:
        raise LaunchError(
            f"--autotuning {args.autotuning}: zstack has no autotuner; set the config's "
            "batch sizes and ZeRO options yourself"
        )
    if args.elastic_training or args.min_elastic_nodes != -1 or args.max_elastic_nodes != -1:
        raise LaunchError(
            "--elastic_training: zstack's launcher runs a fixed set of nodes; for elastic "
            "training run torchrun --nnodes MIN:MAX --rdzv-backend c10d on each node"
        )
    launcher = args.launcher.lower()
    if launcher in REFUSED_LAUNCHERS:
        raise LaunchError(
            f"--launcher {args.launcher}: zstack starts ranks through torchrun on each node "
            f"({', '.join(LAUNCHERS)}); for MPI, start the script with your mpirun yourself "
            "(zcomm.init_distributed reads Open MPI's and MPICH's rank variables)"
        )
    if launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher {args.launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    for flag in ("num_gpus", "num_nodes"):
        value = getattr(args, flag)
        if value == 0 or value < -1:
            raise LaunchError(f"--{flag} {value}: give a count of at least 1")


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


def _launch(args: argparse.Namespace) -> int:
    _refuse(args)
    launcher = args.launcher.lower()
    hostfile = args.hostfile or DLTS_HOSTFILE
    pool = read_hostfile(hostfile)
    if pool is None and args.hostfile is not None:
        raise LaunchError(f"--hostfile {args.hostfile}: no such file")
    if pool is None:
        _log.info("no hostfile at %s: running on this machine only", hostfile)
        count = local_slots()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = visible.split(",") if visible else []
        if ids and all(i.strip().isdigit() for i in ids):
            if args.include or args.exclude or args.num_nodes > 1 or args.num_gpus > 0:
                _log.info(
                    "ignoring CUDA_VISIBLE_DEVICES=%s: slots given on the command line", visible
                )
            else:
                args.include = f"localhost:{visible}"
                _log.info("CUDA_VISIBLE_DEVICES=%s: --include %s", visible, args.include)
                # the ids are the machine's device numbers; torch counts only the visible ones
                count = max(count, *(int(i) + 1 for i in ids))
            del os.environ["CUDA_VISIBLE_DEVICES"]  # each node sets its own from its slots
        if args.num_nodes > 1:
            raise LaunchError(
                f"--num_nodes {args.num_nodes} needs a hostfile listing the hosts "
                f"(none at {hostfile})"
            )
        if args.num_gpus < 0 and not args.include:
            _log.info("%d rank(s) on this machine (--num_gpus N for another count)", count)
        pool = {"localhost": count}
        args.master_addr = args.master_addr or "127.0.0.1"
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
    if launcher == "pdsh":
        if shutil.which("pdsh") is None:
            raise LaunchError(
                "--launcher pdsh: pdsh is not installed (not on PATH); install it, or use "
                "--launcher slurm, or --launcher local when every host is this machine"
            )
        if not args.no_ssh_check:
            check = ["ssh", "-o", "PasswordAuthentication=no"]
            check += ["-p", str(args.ssh_port)] if args.ssh_port is not None else []
            if (
                subprocess.call(
                    [*check, hosts[0], "hostname"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                != 0
            ):
                raise LaunchError(
                    f"host {hosts[0]} is not reachable with passwordless ssh; set it up, or "
                    "remove the hostfile to run on this machine only"
                )
        env["PDSH_RCMD_TYPE"] = "ssh"
        if args.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = (
                f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {args.ssh_port}"
            )
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
