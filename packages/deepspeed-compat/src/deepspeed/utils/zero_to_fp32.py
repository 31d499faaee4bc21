"""``deepspeed.utils.zero_to_fp32``: zengine's, which reads zstack's checkpoints (a pipeline
engine's too) and DeepSpeed's. ``python -m deepspeed.utils.zero_to_fp32 CKPT OUTPUT_DIR`` takes
DeepSpeed's arguments (``--safe_serialization``, ``--max_shard_size``, ``-t/--tag``,
``--exclude_frozen_parameters``, ``-d``) and writes what DeepSpeed's writes."""

import os
import re
import sys
from pathlib import Path

from zengine.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_checkpoint_files",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "main",
]


def _natural_key(path: str) -> list[int | str]:
    # rank 10 after rank 9, as DeepSpeed orders its rank files
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def get_checkpoint_files(checkpoint_dir: str | os.PathLike[str], glob_pattern: str) -> list[str]:
    """DeepSpeed's: the files of `checkpoint_dir` matching `glob_pattern`, in natural order
    (rank 10 after rank 9); none is a ``FileNotFoundError`` naming the pattern and folder."""
    found = sorted((str(p) for p in Path(checkpoint_dir).glob(glob_pattern)), key=_natural_key)
    if not found:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return found


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """DeepSpeed's: a checkpoint tag folder's ``*_optim_states.pt`` files, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """DeepSpeed's: a checkpoint tag folder's ``*_model_states.pt`` files, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


if __name__ == "__main__":
    sys.exit(main())
