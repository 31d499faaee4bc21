"""``deepspeed.launcher.constants``: DeepSpeed's launcher names and the paths its launchers use
(zstack's launcher, `zcomm.launch`, takes the same names)."""

from zcomm.launch import MVAPICH_HOSTFILE, PDSH_MAX_FAN_OUT

__all__ = [
    "IMPI_LAUNCHER",
    "MPICH_LAUNCHER",
    "MVAPICH_LAUNCHER",
    "MVAPICH_TMP_HOSTFILE",
    "OPENMPI_LAUNCHER",
    "PDSH_LAUNCHER",
    "PDSH_MAX_FAN_OUT",
    "SLURM_LAUNCHER",
]

PDSH_LAUNCHER = "pdsh"
OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
SLURM_LAUNCHER = "slurm"
MVAPICH_LAUNCHER = "mvapich"
MVAPICH_TMP_HOSTFILE = MVAPICH_HOSTFILE
