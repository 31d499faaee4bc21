"""``deepspeed.ops.op_builder``: DeepSpeed builds C++/CUDA ops (CPU Adam, async I/O, fused Adam)
and its code asks a builder whether one can be built here (``is_compatible()``, and
``deepspeed.ops.__compatible_ops__[Builder.NAME]``) before using the feature. zstack builds no
ops: its optimizers run on torch's kernels (zengine.ops) and NVMe offload on zoffload's own
file I/O, so every feature a builder stands for is there, and a builder answers that it is;
asking it for the compiled module itself (``load()``) is refused, naming what to use instead."""

from __future__ import annotations

from typing import ClassVar, NoReturn

from deepspeed._refused import UnsupportedFeatureError

__all__ = [
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "FusedAdamBuilder",
    "FusedLionBuilder",
    "OpBuilder",
]


class OpBuilder:
    """A DeepSpeed op builder's questions, answered for zstack."""

    NAME: ClassVar[str] = "op"
    # what to use in zstack instead of the compiled op
    INSTEAD: ClassVar[str] = "zstack runs on torch's kernels"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether the feature is available here: always, it needs no build."""
        del verbose
        return True

    def load(self, verbose: bool = True) -> NoReturn:
        del verbose
        raise UnsupportedFeatureError(
            f"{type(self).__name__}().load(): zstack builds no ops ({self.NAME}); {self.INSTEAD}"
        )


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    INSTEAD = "use deepspeed.ops.adam.DeepSpeedCPUAdam (zengine.ops), on torch's fused Adam"


class CPUAdagradBuilder(OpBuilder):
    NAME = "cpu_adagrad"
    INSTEAD = "use deepspeed.ops.adagrad.DeepSpeedCPUAdagrad (zengine.ops)"


class CPULionBuilder(OpBuilder):
    NAME = "cpu_lion"
    INSTEAD = "use deepspeed.ops.lion.DeepSpeedCPULion (zengine.ops)"


class FusedAdamBuilder(OpBuilder):
    NAME = "fused_adam"
    INSTEAD = "use deepspeed.ops.adam.FusedAdam (zengine.ops), on torch's fused Adam"


class FusedLionBuilder(OpBuilder):
    NAME = "fused_lion"
    INSTEAD = "use deepspeed.ops.lion.FusedLion (zengine.ops)"


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    INSTEAD = "NVMe offload is zoffload's (offload_param / offload_optimizer device nvme)"
