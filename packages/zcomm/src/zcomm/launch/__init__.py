"""zstack's launcher: DeepSpeed's ``deepspeed`` command line, ranks started by torchrun.

``python -m zcomm.launch [DeepSpeed's launcher arguments] SCRIPT ARGS`` (and the compatibility
package's ``deepspeed`` command, and ``zengine launch``) reads DeepSpeed's hostfile, applies
``--include``/``--exclude``/``--num_nodes``/``--num_gpus``, and on each node runs one torchrun
agent (`zcomm.launch.node`) whose ranks get ``--local_rank=N`` before the script's arguments,
as DeepSpeed passes it. Several nodes go through pdsh, srun, or (``--launcher local``) local
processes; with ``--launcher openmpi|mpich|impi|mvapich``, one ``mpirun`` starts every rank
(no torchrun) through the rank shim, which sets torch's rank variables from MPI's. The pieces
are pure functions, so what would run can be checked without running it: `parse_hostfile`,
`parse_inclusion_exclusion`, `resolve_resources`, `node_command`, `torchrun_args`,
`pdsh_command`, `slurm_command`, `openmpi_command`, `mpich_command`, `impi_command`,
`mvapich_command`, `mpi_rank_program`, `mpi_env`.
"""

from zcomm.launch._args import LAUNCHERS, build_parser, parse_args
from zcomm.launch._commands import (
    NODE_MODULE,
    PDSH_MAX_FAN_OUT,
    RANK_SHIM,
    RankOptions,
    node_command,
    pdsh_command,
    pdsh_environment,
    pdsh_kill_command,
    slurm_command,
    torchrun_args,
)
from zcomm.launch._hostfile import (
    DLTS_HOSTFILE,
    LaunchError,
    decode_world_info,
    encode_world_info,
    parse_hostfile,
    parse_inclusion_exclusion,
    parse_node_spec,
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
    slots_per_host,
)
from zcomm.launch._rank import cores_for, mpi_env, parse_core_list
from zcomm.launch._runner import (
    DEEPSPEED_ENVIRONMENT_NAME,
    DEEPSPEED_ENVIRONMENT_PATHS,
    EXPORT_ENVS,
    local_slots,
    main,
    read_env_file,
    resolve_resources,
)

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "DLTS_HOSTFILE",
    "EXPORT_ENVS",
    "LAUNCHERS",
    "MPI_LAUNCHERS",
    "MVAPICH_HOSTFILE",
    "NODE_MODULE",
    "PDSH_MAX_FAN_OUT",
    "RANK_SHIM",
    "LaunchError",
    "RankOptions",
    "build_parser",
    "check_mpi_filters",
    "cores_for",
    "decode_world_info",
    "encode_world_info",
    "impi_command",
    "local_slots",
    "main",
    "mpi_default_exports",
    "mpi_env",
    "mpi_rank_program",
    "mpich_command",
    "mvapich_command",
    "mvapich_hostfile_text",
    "node_command",
    "openmpi_command",
    "parse_args",
    "parse_core_list",
    "parse_hostfile",
    "parse_inclusion_exclusion",
    "parse_node_spec",
    "pdsh_command",
    "pdsh_environment",
    "pdsh_kill_command",
    "read_env_file",
    "read_hostfile",
    "resolve_resources",
    "slots_per_host",
    "slurm_command",
    "torchrun_args",
]
