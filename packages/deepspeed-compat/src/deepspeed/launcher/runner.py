"""``deepspeed.launcher.runner``: the ``deepspeed`` command, on zcomm's launcher.

``deepspeed [--num_gpus N] [--num_nodes N] [-H HOSTFILE] [-i/-e NODE_SPEC] [--master_addr A]
[--master_port P] [--launcher pdsh|slurm|local|openmpi|mpich|impi|mvapich] [--no_local_rank]
... SCRIPT ARGS`` takes DeepSpeed's launcher arguments and starts the ranks through torchrun on
each node (`zcomm.launch`), or with an MPI launcher through one ``mpirun`` (the commands of
`deepspeed.launcher.multinode_runner`); the script gets ``--local_rank=N`` before its own
arguments, as DeepSpeed's launcher passes it (not under MPI, as DeepSpeed's). ``main`` returns
on success and exits with the failed rank's status, as DeepSpeed's does; a launch that cannot
start (a bad hostfile line, ``--include`` naming a host the hostfile lacks, an unknown
``--launcher``) exits 2 with the reason from the command line, and raises it as a
``ValueError`` when ``main(args)`` is called with arguments, as DeepSpeed's
raises.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping, Sequence

from zcomm import launch as _launch
from zcomm.launch import (
    DEEPSPEED_ENVIRONMENT_NAME,
    DEEPSPEED_ENVIRONMENT_PATHS,
    DLTS_HOSTFILE,
    EXPORT_ENVS,
    PDSH_MAX_FAN_OUT,
    encode_world_info,
    parse_hostfile,
    parse_inclusion_exclusion,
    read_hostfile,
)

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "DLTS_HOSTFILE",
    "EXPORT_ENVS",
    "PDSH_MAX_FAN_OUT",
    "encode_world_info",
    "fetch_hostfile",
    "main",
    "parse_args",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
]


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's launcher arguments (its attribute names)."""
    return _launch.parse_args(args, prog="deepspeed")


def fetch_hostfile(hostfile_path: str) -> dict[str, int] | None:
    """``{host: slots}`` from a hostfile, ``None`` when there is none (DeepSpeed's)."""
    return read_hostfile(hostfile_path)


def _parse_hostfile(hostfile_lines: Iterable[str]) -> dict[str, int]:
    """``{host: slots}`` from a hostfile's lines (DeepSpeed's name)."""
    return parse_hostfile(hostfile_lines)


def parse_resource_filter(
    host_info: Mapping[str, Sequence[int]], include_str: str = "", exclude_str: str = ""
) -> dict[str, list[int]]:
    """``host_info`` (``{host: [slot, ...]}``) filtered by an include or exclude string."""
    return parse_inclusion_exclusion(host_info, include_str, exclude_str)


def main(args: Sequence[str] | None = None) -> None:
    """Run the ``deepspeed`` command line ``args`` (default ``sys.argv[1:]``)."""
    code = _launch.main(args, prog="deepspeed", raise_errors=args is not None)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
