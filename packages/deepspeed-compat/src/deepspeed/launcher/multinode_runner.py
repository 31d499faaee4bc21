"""``deepspeed.launcher.multinode_runner``: DeepSpeed's runner classes, one per ``--launcher``,
whose ``get_cmd`` returns the command zstack's launcher runs (`zcomm.launch`).

``PDSHRunner`` and ``SlurmRunner`` build pdsh's and srun's command around zcomm's node launcher
(one torchrun agent per node); ``OpenMPIRunner``, ``MPICHRunner``, ``IMPIRunner`` and
``MVAPICHRunner`` build one ``mpirun`` whose ranks run zcomm's rank shim, which sets torch's
rank variables from MPI's before it execs the script. The signatures are DeepSpeed's:
``Runner(args, world_info_base64[, resource_pool])`` with ``args`` from
``deepspeed.launcher.runner.parse_args``, ``get_cmd(environment, active_resources)`` (pdsh's
returns ``(cmd, kill_cmd, environment)``), ``add_export``, ``backend_exists``, ``name``.

``exports`` holds DeepSpeed's view of each exported value (quoted for a shell when it has
characters a shell would read); the commands are built from the values themselves and quoted
per launcher by zcomm (pdsh through a shell, mpirun and srun without one).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from zcomm.launch import (
    DLTS_HOSTFILE,
    MVAPICH_HOSTFILE,
    RankOptions,
    check_mpi_filters,
    impi_command,
    mpi_default_exports,
    mpi_rank_program,
    mpich_command,
    mvapich_command,
    mvapich_hostfile_text,
    node_command,
    openmpi_command,
    pdsh_command,
    pdsh_environment,
    pdsh_kill_command,
    slurm_command,
)

__all__ = [
    "IMPIRunner",
    "MPICHRunner",
    "MVAPICHRunner",
    "MultiNodeRunner",
    "OpenMPIRunner",
    "PDSHRunner",
    "SlurmRunner",
]

# characters a shell reads as themselves: a value with any other is quoted in `exports`
_SHELL_PLAIN = re.compile(r"[\w@%+=:,./-]*")

# {host: slot count} (a hostfile's pool) or {host: [slot, ...]}
Resources = Mapping[str, int | Sequence[int]]


def _rank_options(args: Any) -> RankOptions:
    """The per-rank flags of DeepSpeed's ``args`` (absent ones at their defaults)."""
    log = getattr(args, "enable_each_rank_log", "None")
    return RankOptions(
        module=bool(getattr(args, "module", False)),
        no_python=bool(getattr(args, "no_python", False)),
        no_local_rank=bool(getattr(args, "no_local_rank", False)),
        each_rank_log=None if log in ("None", None, "") else str(log),
        bind_cores_to_rank=bool(getattr(args, "bind_cores_to_rank", False)),
        bind_core_list=getattr(args, "bind_core_list", None),
    )


class MultiNodeRunner(ABC):
    """DeepSpeed's base of the launcher backends: ``args`` (the launcher's namespace), the
    encoded world info, the exported variables, the user's script and arguments."""

    def __init__(self, args: Any, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments: list[str] = self.parse_user_args()
        self.user_script: str = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}
        self._values: dict[str, str] = {}  # the exported values as given, unquoted

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether this launcher's program is installed here."""

    @abstractmethod
    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> Any:
        """The command that starts every rank."""

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` to every rank (DeepSpeed's: surrounding blanks dropped, a value
        with shell characters double-quoted in `exports`)."""
        value = var.strip()
        self._values[key.strip()] = value
        self.exports[key.strip()] = value if _SHELL_PLAIN.fullmatch(value) else f'"{value}"'

    def parse_user_args(self) -> list[str]:
        """The script's arguments (zcomm quotes them for each launcher)."""
        return list(self.args.user_args)

    @property
    def name(self) -> str:
        """The backend's name."""
        return self.__class__.__name__

    def validate_args(self) -> None:
        """Raise ``ValueError`` for arguments this backend cannot honour (none here)."""
        return None

    @classmethod
    def validate_active_resources(cls, active_resources: Resources) -> None:
        """DeepSpeed 0.19's check of a resolved filter; zstack's backends take any."""
        del active_resources

    # shared by the backends
    def _master(self, resources: Resources) -> tuple[str, int]:
        address = getattr(self.args, "master_addr", "") or next(iter(resources))
        return address, int(getattr(self.args, "master_port", 29500))

    def _launcher_args(self) -> str:
        return str(getattr(self.args, "launcher_args", "") or "")

    def _node_command(self, node_rank: int | str, resources: Resources) -> list[str]:
        address, port = self._master(resources)
        level = getattr(self.args, "log_level", None)
        return node_command(
            self.world_info_base64,
            node_rank,
            address,
            port,
            self.user_script,
            self.user_arguments,
            _rank_options(self.args),
            save_pid=os.getpid() if getattr(self.args, "save_pid", False) else None,
            log_level="error" if getattr(self.args, "quiet", False) else level,
        )


class PDSHRunner(MultiNodeRunner):
    """pdsh runs zcomm's node launcher (``--node_rank=%n``) on every host."""

    def backend_exists(self) -> bool:
        return shutil.which("pdsh") is not None

    @property
    def name(self) -> str:
        return "pdsh"

    def get_cmd(
        self, environment: dict[str, str], active_resources: Resources
    ) -> tuple[list[str], list[str], dict[str, str]]:
        """``(pdsh command, the command that stops it on every host, environment)``; the
        environment gets pdsh's ssh settings, as DeepSpeed's."""
        environment.update(pdsh_environment(environment, getattr(self.args, "ssh_port", None)))
        hosts = list(active_resources)
        cmd = pdsh_command(
            hosts,
            self._node_command("%n", active_resources),
            self._values,
            os.path.abspath("."),
            self._launcher_args(),
            getattr(self.args, "venv_script", None),
        )
        kill = pdsh_kill_command(hosts, self.world_info_base64, self._launcher_args())
        return cmd, kill, environment


class SlurmRunner(MultiNodeRunner):
    """srun runs zcomm's node launcher once on every host (each finds itself from Slurm's
    variables); the exports travel in srun's environment."""

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Resources) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def backend_exists(self) -> bool:
        return shutil.which("sinfo") is not None

    @property
    def name(self) -> str:
        return "slurm"

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        environment.update(self._values)
        node = self._node_command(-1, active_resources)
        return slurm_command(list(active_resources), node, self._launcher_args())


class _MPIRunner(MultiNodeRunner):
    """One ``mpirun`` for every slot of ``resource_pool``; its ranks run zcomm's rank shim."""

    launcher = ""

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Resources) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool
        for key, value in mpi_default_exports(self.launcher, _on_cuda()).items():
            self.add_export(key, value)

    @property
    def name(self) -> str:
        return self.launcher

    def backend_exists(self) -> bool:
        return shutil.which("mpirun") is not None

    def validate_args(self) -> None:
        args = self.args
        check_mpi_filters(self.launcher, args.include, args.exclude, args.num_nodes, args.num_gpus)

    def _program(self) -> list[str]:
        return mpi_rank_program(self.user_script, self.user_arguments, _rank_options(self.args))


def _on_cuda() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().device_name() == "cuda")


class OpenMPIRunner(_MPIRunner):
    """Open MPI's ``mpirun -n TOTAL -hostfile HOSTFILE``, exports as ``-x K=V``."""

    launcher = "openmpi"

    def backend_exists(self) -> bool:
        return shutil.which("ompi_info") is not None

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        del environment, active_resources  # every slot of the pool
        hostfile = getattr(self.args, "hostfile", None) or DLTS_HOSTFILE
        address, port = self._master(self.resource_pool)
        return openmpi_command(
            self.resource_pool,
            hostfile if os.path.isfile(hostfile) else None,
            self._program(),
            self._values,
            address,
            port,
            self._launcher_args(),
        )


class MPICHRunner(_MPIRunner):
    """MPICH's ``mpirun -n TOTAL -ppn PER_HOST -hosts ...``, exports as ``-genv K V``."""

    launcher = "mpich"

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        del environment, active_resources
        address, port = self._master(self.resource_pool)
        return mpich_command(
            self.resource_pool, self._program(), self._values, address, port, self._launcher_args()
        )


class IMPIRunner(_MPIRunner):
    """Intel MPI's ``mpirun -ppn PER_HOST ... -n TOTAL``, its own pinning off."""

    launcher = "impi"

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        del environment, active_resources
        address, port = self._master(self.resource_pool)
        return impi_command(
            self.resource_pool, self._program(), self._values, address, port, self._launcher_args()
        )


class MVAPICHRunner(_MPIRunner):
    """MVAPICH2's ``mpirun -np TOTAL -ppn PER_HOST --hostfile /tmp/deepspeed_mvapich_hostfile``
    (written by `get_cmd`, one host a line, as DeepSpeed's)."""

    launcher = "mvapich"

    def backend_exists(self) -> bool:
        if shutil.which("mpiname") is None:
            return False
        out = subprocess.run(["mpiname"], capture_output=True, text=True, check=False).stdout
        return "MVAPICH" in out

    def get_cmd(self, environment: dict[str, str], active_resources: Resources) -> list[str]:
        del environment, active_resources
        address, port = self._master(self.resource_pool)
        cmd = mvapich_command(
            self.resource_pool, self._program(), self._values, address, port, self._launcher_args()
        )
        with open(MVAPICH_HOSTFILE, "w") as file:
            file.write(mvapich_hostfile_text(self.resource_pool))
        return cmd
