"""``deepspeed.runtime.zero.utils``: `is_zero_param` and `apply_to_tensors_only` (zpartition's),
and `ZeRORuntimeException`, which is zengine's public `UsageError` (what the engine raises for a
call or a combination it refuses: a client optimizer with ZeRO-Offload, an
``allgather_bucket_size`` DeepSpeed rejects, ``no_sync`` misuse)."""

from zengine import UsageError as ZeRORuntimeException
from zpartition import apply_to_tensors_only, is_zero_param

__all__ = ["ZeRORuntimeException", "apply_to_tensors_only", "is_zero_param"]
