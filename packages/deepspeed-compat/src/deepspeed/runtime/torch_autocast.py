"""``deepspeed.runtime.torch_autocast``: which parameters communicate in the autocast dtype
(zengine's ``torch_autocast`` support)."""

from zengine import get_comm_dtype, has_comm_dtype

__all__ = ["PARAM_COMM_DTYPE_ATTR_NAME", "get_comm_dtype", "has_comm_dtype"]

# the parameter attribute holding that dtype: the same name in DeepSpeed and zengine
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"
