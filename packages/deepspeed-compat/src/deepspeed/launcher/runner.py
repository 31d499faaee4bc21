"""``deepspeed.launcher.runner``: DeepSpeed's launcher constants. zstack has no launcher of its
own: ``torchrun`` (or ``accelerate launch``) starts the ranks."""

import os

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS"]

# The file of extra environment variables DeepSpeed's launcher exports to every node
# (Accelerate's multi-node launch writes it); read from the same places.
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
