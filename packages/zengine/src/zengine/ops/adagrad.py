"""DeepSpeed's ``DeepSpeedCPUAdagrad``: torch's Adagrad (fused where the parameters allow it)
with DeepSpeed's signature."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``; ``amsgrad`` is refused, as
    Adagrad has no such variant, and ``fp32_optimizer_states`` is taken."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("DeepSpeedCPUAdagrad does not support the AMSGrad variant")
        params = list(model_params)
        # torch's fused Adagrad runs on CPU only (DeepSpeed's is a CPU optimizer too)
        tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
        on_cpu = all(t.device.type == "cpu" and t.is_floating_point() for t in tensors)
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay, fused=on_cpu or None)
        self.fp32_optimizer_states = fp32_optimizer_states
