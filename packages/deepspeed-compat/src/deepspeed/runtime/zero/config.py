"""``deepspeed.runtime.zero.config``: DeepSpeed's ZeRO section models, which are zengine's
(`zengine.config`): the same keys, defaults and errors; DeepSpeed's ``stage3_`` keys keep that
prefix as attribute names (``stage3_prefetch_bucket_size``), and an offload section left out
is one with ``device`` "none" rather than None."""

from zengine.config import OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig
from zengine.config import OffloadParamConfig as DeepSpeedZeroOffloadParamConfig
from zengine.config import ZeroConfig as DeepSpeedZeroConfig

__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
]
