"""zstack's launcher: DeepSpeed's ``deepspeed`` command line, ranks started by torchrun.

``python -m zcomm.launch [DeepSpeed's launcher arguments] SCRIPT ARGS`` (and the compatibility
package's ``deepspeed`` command, and ``zengine launch``) reads DeepSpeed's hostfile, applies
``--include``/``--exclude``/``--num_nodes``/``--num_gpus``, and on each node runs one torchrun
agent (`zcomm.launch.node`) whose ranks get ``--local_rank=N`` before the script's arguments,
as DeepSpeed passes it. Several nodes go through pdsh, srun, or (``--launcher local``) local
processes. The pieces are pure functions, so what would run can be checked without running it:
`parse_hostfile`, `parse_inclusion_exclusion`, `resolve_resources`, `node_command`,
`torchrun_args`, `pdsh_command`, `slurm_command`.
"""

from zcomm.launch._args import LAUNCHERS, REFUSED_LAUNCHERS, build_parser, parse_args
from zcomm.launch._commands import (
    NODE_MODULE,
    PDSH_MAX_FAN_OUT,
    RANK_SHIM,
    RankOptions,
    node_command,
    pdsh_command,
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
    "NODE_MODULE",
    "PDSH_MAX_FAN_OUT",
    "RANK_SHIM",
    "REFUSED_LAUNCHERS",
    "LaunchError",
    "RankOptions",
    "build_parser",
    "decode_world_info",
    "encode_world_info",
    "local_slots",
    "main",
    "node_command",
    "parse_args",
    "parse_hostfile",
    "parse_inclusion_exclusion",
    "parse_node_spec",
    "pdsh_command",
    "pdsh_kill_command",
    "read_env_file",
    "read_hostfile",
    "resolve_resources",
    "slurm_command",
    "torchrun_args",
]
