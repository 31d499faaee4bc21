"""``deepspeed.runtime.zero.utils``: `is_zero_param` and `apply_to_tensors_only` (zpartition's)."""

from zpartition import apply_to_tensors_only, is_zero_param

__all__ = ["apply_to_tensors_only", "is_zero_param"]
