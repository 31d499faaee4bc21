"""``deepspeed.runtime.fp16``: DeepSpeed's loss scalers and fp16 optimizers on zengine. Its
submodules are imported here, as DeepSpeed's package imports them."""

from deepspeed.runtime.fp16 import fused_optimizer, loss_scaler, unfused_optimizer

__all__ = ["fused_optimizer", "loss_scaler", "unfused_optimizer"]
