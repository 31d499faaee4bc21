"""``deepspeed.utils.zero_to_fp32``: zengine's, which reads zstack's checkpoints (a pipeline
engine's too) and DeepSpeed's. ``python -m deepspeed.utils.zero_to_fp32 CKPT OUTPUT_DIR`` takes
DeepSpeed's arguments (``--safe_serialization``, ``--max_shard_size``, ``-t/--tag``,
``--exclude_frozen_parameters``, ``-d``) and writes what DeepSpeed's writes."""

import sys

from zengine.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
]

if __name__ == "__main__":
    sys.exit(main())
