"""``zero_to_fp32.py`` in a checkpoint's save_dir, as DeepSpeed writes it there.

DeepSpeed's ``save_checkpoint`` copies its ``deepspeed/utils/zero_to_fp32.py`` into the save_dir
(rank 0) and makes it executable, and its users, and Accelerate's error messages, run
``python zero_to_fp32.py . OUT`` from that folder to get the model without DeepSpeed. zstack's
script is a few lines that run ``zengine.utils.zero_to_fp32``'s command line (DeepSpeed's
arguments, zengine's reader): the reading stays in the installed package, so an old
checkpoint's script reads with the zengine that is installed when it runs.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from zengine._checkpoint import _files as files

__all__ = ["SCRIPT", "change_permissions", "write_recovery_script"]

log = logging.getLogger("zengine")

SCRIPT = "zero_to_fp32.py"  # DeepSpeed's name

_TEXT = '''\
#!/usr/bin/env python
"""This checkpoint folder's model as one fp32 state dict, without the training engine.

Written by zstack's save_checkpoint, as DeepSpeed writes its zero_to_fp32.py here, with
DeepSpeed's arguments:

    python zero_to_fp32.py . OUTPUT_DIR [--safe_serialization] [--max_shard_size 5GB]
        [-t TAG] [--exclude_frozen_parameters]

writes OUTPUT_DIR/pytorch_model.bin (model.safetensors with --safe_serialization), or shards
of at most --max_shard_size and their index, as Hugging Face names them. The reading is
zengine's (``zengine.utils.zero_to_fp32``), which must be installed: pip install zengine.
"""

import sys

try:
    from zengine.utils.zero_to_fp32 import *  # noqa: F403 - DeepSpeed's functions, importable here
    from zengine.utils.zero_to_fp32 import main
except ImportError as error:
    sys.exit(
        f"zero_to_fp32.py: this checkpoint was saved by zstack; converting it needs the zengine "
        f"package (pip install zengine), which cannot be imported here: {error}"
    )

if __name__ == "__main__":
    sys.exit(main())
'''


def change_permissions(path: str | os.PathLike[str]) -> None:
    """Make `path` executable, as DeepSpeed makes its copy; a file system that refuses (an
    Azure file share) is said in the log, and the save goes on (DeepSpeed's test of it patches
    its logger's ``info``, so the message goes there, as DeepSpeed's does)."""
    try:
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    except (FileNotFoundError, PermissionError) as error:
        log.info(
            "Warning: Could not change permissions for %s due to error: %s. Continuing without "
            "changing permissions.",
            path,
            error,
        )


def write_recovery_script(save_dir: Path) -> Path:
    """Write ``zero_to_fp32.py`` into `save_dir` (atomically: a concurrent reader sees a whole
    script) and make it executable."""
    path = save_dir / SCRIPT
    files.write_atomic(path, _TEXT.encode())
    change_permissions(path)
    return path
