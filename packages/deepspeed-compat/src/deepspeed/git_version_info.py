"""``deepspeed.git_version_info``: what DeepSpeed records of its build. zstack builds no ops, so
the versions its tests read are "0.0" where DeepSpeed's mean "not recorded, ask torch at run
time" (its tests do exactly that), and the torch version is the running one."""

from __future__ import annotations

import torch

from deepspeed.__about__ import __version__

__all__ = ["compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]

version = __version__
git_hash = "unknown"
git_branch = "unknown"
installed_ops: dict[str, bool] = {}  # no JIT- or pre-built ops: zstack runs on torch's kernels
compatible_ops: dict[str, bool] = {}
torch_info = {
    "version": ".".join(torch.__version__.split(".")[:2]),
    "bf16_support": False,
    "cuda_version": "0.0",
    "nccl_version": "0.0",
    "hip_version": "0.0",
}
