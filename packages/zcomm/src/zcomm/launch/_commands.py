"""The commands a launch runs, as exact argument lists (pure functions, tested as such).

One shape at every level, as DeepSpeed's launcher has it:

- the node command (`node_command`): ``python -u -m zcomm.launch.node --world_info=...
  --node_rank=R ... SCRIPT ARGS``, run once per node: here (one node, ``--no_ssh``, the
  ``local`` launcher), through pdsh (`pdsh_command`, ``--node_rank=%n``) or srun
  (`slurm_command`, the node found from Slurm's variables);
- on the node, torchrun's arguments (`torchrun_args`): one elastic agent with
  ``--nnodes``/``--node-rank``/``--nproc-per-node`` and the static rendezvous at
  ``--master-addr:--master-port``, whose workers run the rank shim (`RANK_SHIM`);
- the rank shim passes ``--local_rank=N`` before the script's own arguments (DeepSpeed's
  order), binds cores and redirects output when asked, then execs the script.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NODE_MODULE",
    "PDSH_MAX_FAN_OUT",
    "RANK_SHIM",
    "RankOptions",
    "node_command",
    "pdsh_command",
    "pdsh_environment",
    "pdsh_kill_command",
    "slurm_command",
    "torchrun_args",
]

NODE_MODULE = "zcomm.launch.node"
PDSH_MAX_FAN_OUT = 1024  # DeepSpeed's pdsh -f
# Run by path, not with -m: it imports nothing but the standard library, so a rank's start
# costs one interpreter start before the exec, not a torch import.
RANK_SHIM = str(Path(__file__).with_name("_rank.py"))


@dataclass(frozen=True)
class RankOptions:
    """How each rank's process is started (DeepSpeed's per-rank launcher flags)."""

    module: bool = False  # python -m SCRIPT
    no_python: bool = False  # exec SCRIPT itself
    no_local_rank: bool = False  # do not pass --local_rank=N
    each_rank_log: str | None = None  # a folder: each rank's stdout+stderr to its own file
    bind_cores_to_rank: bool = False  # each local rank on its own share of the cores
    bind_core_list: str | None = None  # the cores to share ("0-3,8"), default all of them

    def flags(self) -> list[str]:
        """These options as the node command's flags (DeepSpeed's launch.py names)."""
        out: list[str] = []
        if self.module:
            out.append("--module")
        if self.no_python:
            out.append("--no_python")
        if self.no_local_rank:
            out.append("--no_local_rank")
        if self.each_rank_log is not None:
            out.append(f"--enable_each_rank_log={self.each_rank_log}")
        if self.bind_cores_to_rank:
            out.append("--bind_cores_to_rank")
        if self.bind_core_list is not None:
            out.append(f"--bind_core_list={self.bind_core_list}")
        return out


def node_command(
    world_info: str,
    node_rank: int | str,
    master_addr: str,
    master_port: int,
    script: str,
    script_args: Sequence[str] = (),
    rank: RankOptions = RankOptions(),
    *,
    save_pid: int | None = None,
    log_level: str | None = None,
    python: str | None = None,
) -> list[str]:
    """The command that starts one node's ranks (``node_rank`` -1: found from Slurm's
    variables on the node; ``"%n"``: pdsh's substitution)."""
    cmd = [
        python or sys.executable,
        "-u",
        "-m",
        NODE_MODULE,
        f"--world_info={world_info}",
        f"--node_rank={node_rank}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        *rank.flags(),
    ]
    if save_pid is not None:
        cmd.append(f"--save_pid={save_pid}")
    if log_level is not None:
        cmd.append(f"--log_level={log_level}")
    return [*cmd, script, *script_args]


def torchrun_args(
    nnodes: int,
    node_rank: int,
    nproc: int,
    master_addr: str,
    master_port: int,
    script: str,
    script_args: Sequence[str] = (),
    rank: RankOptions = RankOptions(),
    *,
    log_prefix: str = "",
) -> list[str]:
    """``torch.distributed.run``'s arguments for one node: a static rendezvous at
    ``master_addr:master_port`` (node ranks as given, so global ranks follow the hostfile's
    order), no restarts (DeepSpeed's launcher restarts nothing), and the rank shim."""
    # --mode comes first, always: a leading "--" would be eaten by torchrun's own parser
    mode = "module" if rank.module else "exec" if rank.no_python else "python"
    shim = [f"--mode={mode}"]
    if not rank.no_local_rank:
        shim.append("--local_rank")
    if rank.each_rank_log is not None:
        shim += ["--log_dir", rank.each_rank_log, "--log_prefix", log_prefix]
    if rank.bind_cores_to_rank:
        shim += ["--bind_cores", rank.bind_core_list or "all"]
    return [
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        "--max-restarts=0",
        RANK_SHIM,
        *shim,
        "--",
        script,
        *script_args,
    ]


def _pdsh_prefix(hosts: Sequence[str], launcher_args: str) -> list[str]:
    return [
        "pdsh",
        "-S",
        "-f",
        str(PDSH_MAX_FAN_OUT),
        "-w",
        ",".join(hosts),
        *shlex.split(launcher_args),
    ]


def pdsh_command(
    hosts: Sequence[str],
    node_cmd: Sequence[str],
    exports: Mapping[str, str],
    cwd: str,
    launcher_args: str = "",
    venv_script: str | None = None,
) -> list[str]:
    """``pdsh`` running ``node_cmd`` (with ``--node_rank=%n``) on every host: pdsh joins the
    words into one line for each host's shell, so each is shell-quoted here; the exports
    and a ``cd`` to this directory come first, as in DeepSpeed's."""
    remote: list[str] = []
    if venv_script is not None:
        remote.append(f"source {shlex.quote(venv_script)};")
    remote += [f"export {key}={shlex.quote(value)};" for key, value in exports.items()]
    remote.append(f"cd {shlex.quote(cwd)};")
    remote += [shlex.quote(word) for word in node_cmd]
    return _pdsh_prefix(hosts, launcher_args) + remote


def pdsh_environment(environ: Mapping[str, str], ssh_port: int | None = None) -> dict[str, str]:
    """pdsh's environment: its remote command through ssh, on ``ssh_port`` when given
    (appended to ``PDSH_SSH_ARGS_APPEND``), as DeepSpeed's runner sets it."""
    env = dict(environ)
    env["PDSH_RCMD_TYPE"] = "ssh"
    if ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {ssh_port}"
    return env


def pdsh_kill_command(hosts: Sequence[str], world_info: str, launcher_args: str = "") -> list[str]:
    """``pdsh`` stopping this launch's node commands (found by their world info) on every
    host, for when the launcher is interrupted."""
    pattern = f"{NODE_MODULE} --world_info={world_info}"
    return [*_pdsh_prefix(hosts, launcher_args), "pkill", "-f", shlex.quote(pattern)]


def slurm_command(
    hosts: Sequence[str], node_cmd: Sequence[str], launcher_args: str = ""
) -> list[str]:
    """``srun`` with one task on each host, running ``node_cmd`` (``--node_rank=-1``: each
    finds its node from ``SLURMD_NODENAME``). The exports travel in srun's environment
    (``--export=ALL``), so values holding commas need no escaping."""
    return [
        "srun",
        f"--nodes={len(hosts)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(hosts)}",
        *shlex.split(launcher_args),
        "--export=ALL",
        *node_cmd,
    ]
