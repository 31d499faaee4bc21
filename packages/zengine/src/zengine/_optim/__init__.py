"""The optimizer side: the ZeRO optimizer and what it steps.

Owns the ZeRO optimizer (_zero_optimizer.py), the flat fp32 partitions (_partitions.py), the
flat (stages 0-2) and sharded (stage 3) layouts that fill them (_layouts.py), the gradient
buckets of stages 0-2 (_grad_buckets.py), DeepSpeed's attribute names as views of its state
(_deepspeed_views.py), mixed precision: the loss scalers (_loss_scaler.py) and
``torch_autocast`` (_autocast.py), and DeepSpeed's LR schedules (_lr_schedules.py). Not where
its state is offloaded to (_offload), nor how `initialize` builds it from the config.
"""

from zengine._optim._autocast import (
    autocast_dtype,
    autocast_loss_scaler,
    forward_autocast,
    get_comm_dtype,
    has_comm_dtype,
    mark_comm_dtypes,
)
from zengine._optim._layouts import ALIGNMENT, FlatLayout, ShardedLayout
from zengine._optim._loss_scaler import (
    DynamicLossScaler,
    LossScalerBase,
    MinLossScaleError,
    StaticLossScaler,
)
from zengine._optim._lr_schedules import (
    LRRangeTest,
    OneCycle,
    Scheduler,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)
from zengine._optim._partitions import Fragment
from zengine._optim._zero_optimizer import Layout, ZeroOptimizer

__all__ = [
    "ALIGNMENT",
    "DynamicLossScaler",
    "FlatLayout",
    "Fragment",
    "LRRangeTest",
    "Layout",
    "LossScalerBase",
    "MinLossScaleError",
    "OneCycle",
    "Scheduler",
    "ShardedLayout",
    "StaticLossScaler",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroOptimizer",
    "autocast_dtype",
    "autocast_loss_scaler",
    "build_scheduler",
    "forward_autocast",
    "get_comm_dtype",
    "has_comm_dtype",
    "mark_comm_dtypes",
]
