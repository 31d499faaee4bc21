"""``deepspeed.utils.numa``: DeepSpeed's core lists (``--bind_core_list``) and the numactl
command of a rank's share of the cores, on zcomm's launcher's core binding
(`zcomm.launch.parse_core_list`, `zcomm.launch.cores_for`: the split that
``--bind_cores_to_rank`` applies).

zstack's launcher binds through the rank shim (``sched_setaffinity``), not numactl;
`get_numactl_cmd` is here for scripts that build their own command with it. It binds memory to
the NUMA node holding all of the rank's cores (``-m N``), as DeepSpeed does on ordinary
machines; DeepSpeed's special cases for HBM-only and fake NUMA nodes are not reproduced (the
rank's cores are then given without ``-m``). With no ``bind_core_list``, the cores are those
this process may run on (DeepSpeed counts the physical cores from 0).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from zcomm.launch import cores_for, parse_core_list

__all__ = [
    "check_for_numactl_pkg",
    "get_numa_cores",
    "get_numactl_cmd",
    "parse_range",
    "parse_range_list",
]

_NODES = Path("/sys/devices/system/node")


def parse_range(rng: str) -> range:
    """``"5"`` -> ``range(5, 6)``, ``"2-4"`` -> ``range(2, 5)``; a range that ends before it
    starts, or anything else, raises ``ValueError``."""
    if "," in rng:
        raise ValueError(f"Bad range: {rng!r}, expected N or N-M")
    cores = parse_core_list(rng)
    return range(cores[0], cores[-1] + 1)


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``: numbers and ``N-M`` ranges, ascending and not
    overlapping (DeepSpeed's rule), else ``ValueError`` naming the part at fault."""
    return parse_core_list(range_str)


def get_numa_cores() -> list[list[int]]:
    """The cores of each NUMA node, node 0 first (an empty list for a node without cores, such
    as HBM); ``[]`` where Linux does not describe the nodes (read from sysfs, so numactl need
    not be installed)."""
    nodes = sorted(
        (int(path.name[4:]), path)
        for path in _NODES.glob("node[0-9]*")
        if path.name[4:].isdigit() and (path / "cpulist").is_file()
    )
    out: list[list[int]] = []
    for _, path in nodes:
        text = (path / "cpulist").read_text().strip()
        out.append(parse_core_list(text) if text else [])
    return out


def check_for_numactl_pkg() -> bool:
    """Whether the ``numactl`` program is on PATH (printing how to get it when it is not)."""
    if shutil.which("numactl") is not None:
        return True
    print("numactl is not installed: install the numactl package (apt, yum, pacman)")
    return False


def _ranges(cores: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (numactl's ``-C`` form)."""
    parts: list[str] = []
    start = prev = cores[0]
    for core in [*cores[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(parts)


def get_numactl_cmd(
    bind_core_list: str | None, num_local_procs: int, local_rank: int
) -> tuple[int, list[str]]:
    """``(cores per rank, ["numactl", ("-m", NODE,) "-C", CORES])`` for local rank
    ``local_rank`` of ``num_local_procs``: its equal share of ``bind_core_list`` (or of the
    cores this process may use), its memory on their NUMA node when they share one."""
    check_for_numactl_pkg()
    if "KMP_AFFINITY" in os.environ:
        raise ValueError(
            "KMP_AFFINITY is set: it fights numactl over which cores each thread uses; "
            "unset it (unset KMP_AFFINITY) before launching"
        )
    if bind_core_list is not None:
        cores = parse_core_list(bind_core_list)
    else:
        cores = sorted(os.sched_getaffinity(0))
    mine = cores_for(cores, local_rank, num_local_procs)
    cmd = ["numactl"]
    node = next(
        (index for index, node in enumerate(get_numa_cores()) if node and set(mine) <= set(node)),
        None,
    )
    if node is not None:
        cmd += ["-m", str(node)]
    return len(mine), [*cmd, "-C", _ranges(mine)]
