"""The ``deepspeed`` command line: DeepSpeed's launcher arguments, names and defaults, and the
ones zstack refuses, with the reason (`refuse`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from zcomm.launch._hostfile import DLTS_HOSTFILE, LaunchError
from zcomm.launch._mpi import MPI_LAUNCHERS

__all__ = ["DEFAULT_PORT", "LAUNCHERS", "build_parser", "parse_args", "refuse"]

DEFAULT_PORT = 29500  # torch.distributed's and DeepSpeed's
# local: zstack's, every host is this machine; the MPI ones run mpirun (zcomm.launch._mpi)
LAUNCHERS = ("pdsh", "slurm", "local", *MPI_LAUNCHERS)


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
        help="how several nodes are started: pdsh, slurm, local (zstack: every host is "
        "this machine), or mpirun of openmpi, mpich, impi, mvapich",
    )
    add(
        "--launcher_args",
        default="",
        help="arguments for pdsh, srun or mpirun, one quoted string",
    )
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
    # DeepSpeed's, refused by name (see refuse)
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


def refuse(args: argparse.Namespace) -> None:
    """Raise `LaunchError` for what zstack's launcher does not do, or arguments that clash."""
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
    if launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher {args.launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    for flag in ("num_gpus", "num_nodes"):
        value = getattr(args, flag)
        if value == 0 or value < -1:
            raise LaunchError(f"--{flag} {value}: give a count of at least 1")
