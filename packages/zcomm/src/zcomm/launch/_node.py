"""One node's ranks, through one torchrun agent (``python -m zcomm.launch.node``).

DeepSpeed's ``deepspeed.launcher.launch`` arguments (``--world_info``, ``--node_rank``,
``--master_addr``, ``--master_port``, ``--module``, ``--no_python``, ``--no_local_rank``,
``--save_pid``, ``--enable_each_rank_log``, ``--bind_cores_to_rank``, ``--bind_core_list``,
``--log_level``/``--quiet``, then the script and its arguments). This node's slots are its
entry in the world info; the device ids among them become ``CUDA_VISIBLE_DEVICES``, and
DeepSpeed's ``CROSS_RANK``/``CROSS_SIZE``/``LOCAL_SIZE`` are set beside torchrun's variables.
``--node_rank=-1`` finds the node from Slurm's ``SLURMD_NODENAME`` (else ``SLURM_NODEID``).
torch.distributed.run then runs in this process; the exit status is the failed rank's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from zcomm.launch._commands import RankOptions, torchrun_args
from zcomm.launch._hostfile import LaunchError, decode_world_info

__all__ = ["main", "parse_args", "select_node"]

_log = logging.getLogger("zcomm.launch")
PID_FILE_DIR = "/tmp"  # DeepSpeed's: --save_pid P writes /tmp/P.deepspeed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zcomm.launch.node",
        description="Start one node's ranks through torchrun (DeepSpeed's per-node launcher).",
    )
    p.add_argument("--node_rank", type=int, default=0, help="this node's index in --world_info")
    p.add_argument("--master_addr", default="127.0.0.1", help="node 0's address")
    p.add_argument("--master_port", type=int, default=29500, help="the rendezvous port")
    p.add_argument("--world_info", default="None", help="base64 JSON {host: [slot, ...]}")
    p.add_argument("--module", action="store_true", help="run the script as python -m")
    p.add_argument("--no_python", action="store_true", help="exec the script itself")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank")
    p.add_argument("--save_pid", type=int, default=0, help="write /tmp/SAVE_PID.deepspeed")
    p.add_argument("--enable_each_rank_log", default="None", help="a folder for rank logs")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="cores per local rank")
    p.add_argument("--bind_core_list", default=None, help="the cores to share, e.g. 0-7,16")
    p.add_argument("--enable_elastic_training", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--min_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--max_elastic_nodes", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument(
        "--log_level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="this launcher's log level",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="same as --log_level error")
    p.add_argument("training_script", help="the script (or module) each rank runs")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The node launcher's arguments (DeepSpeed's launch.py names)."""
    return _parser().parse_args(argv)


def select_node(
    world_info: dict[str, list[int]], node_rank: int, environ: dict[str, str] | None = None
) -> int:
    """This node's index in ``world_info``: ``node_rank``, or for -1 the host Slurm names
    (``SLURMD_NODENAME``, else the index ``SLURM_NODEID``)."""
    hosts = list(world_info)
    if node_rank >= 0:
        if node_rank >= len(hosts):
            raise LaunchError(
                f"--node_rank {node_rank}: the world info has {len(hosts)} node(s) ({hosts})"
            )
        return node_rank
    env = os.environ if environ is None else environ
    name = env.get("SLURMD_NODENAME")
    if name is not None and name in world_info:
        return hosts.index(name)
    slurm_id = env.get("SLURM_NODEID")
    if slurm_id is not None and slurm_id.isdigit() and int(slurm_id) < len(hosts):
        return int(slurm_id)
    raise LaunchError(
        f"--node_rank -1: this node (SLURMD_NODENAME={name!r}, SLURM_NODEID={slurm_id!r}) "
        f"is not one of the hostfile's hosts {hosts}"
    )


def _run_torchrun(args: list[str]) -> int:
    """torch.distributed.run in this process; the failed rank's exit status, else 0."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(args)
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr)  # type: ignore[no-untyped-call]
        codes = [failure.exitcode for failure in error.failures.values()]
        return next((code for code in codes if code > 0), 1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="[zcomm.launch] %(message)s")
    _log.setLevel("ERROR" if args.quiet else args.log_level.upper())
    try:
        if args.enable_elastic_training:
            raise LaunchError(
                "--enable_elastic_training: zstack's launcher runs a fixed set of nodes; for "
                "elastic training run torchrun --nnodes MIN:MAX --rdzv-backend c10d yourself"
            )
        if args.module and args.no_python:
            raise LaunchError("--module and --no_python cannot be used together")
        if args.world_info == "None":
            raise LaunchError("--world_info is required (base64 JSON {host: [slot, ...]})")
        world_info = decode_world_info(args.world_info)
        node = select_node(world_info, args.node_rank)
    except LaunchError as error:
        print(f"zcomm.launch.node: error: {error}", file=sys.stderr)
        return 2
    host = list(world_info)[node]
    slots = world_info[host]
    # the slots are device ids on this node: rank i uses device slots[i], as DeepSpeed's
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    os.environ["CROSS_RANK"] = str(node)
    os.environ["CROSS_SIZE"] = str(len(world_info))
    os.environ["LOCAL_SIZE"] = str(len(slots))
    log_dir = None if args.enable_each_rank_log == "None" else args.enable_each_rank_log
    if log_dir is not None:
        if Path(log_dir).is_file():
            print(f"zcomm.launch.node: error: {log_dir} is a file, not a folder", file=sys.stderr)
            return 2
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    rank = RankOptions(
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        each_rank_log=log_dir,
        bind_cores_to_rank=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
    )
    run_args = torchrun_args(
        len(world_info),
        node,
        len(slots),
        args.master_addr,
        args.master_port,
        args.training_script,
        args.training_script_args,
        rank,
        log_prefix=time.strftime("%Y%m%d%H%M%S"),
    )
    _log.info(
        "node %d/%d (%s, slots %s): python -m torch.distributed.run %s",
        node,
        len(world_info),
        host,
        slots,
        " ".join(run_args),
    )
    pid_file = Path(PID_FILE_DIR, f"{args.save_pid}.deepspeed") if args.save_pid else None
    if pid_file is not None:
        print(f"launcher pid: {os.getpid()}")
        pid_file.write_text(str(os.getpid()))
    try:
        return _run_torchrun(run_args)
    finally:
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)
