"""DeepSpeed's ``FusedLion`` and ``DeepSpeedCPULion`` (``deepspeed.ops.lion``): the Lion
optimizer (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023) on torch's
multi-tensor ops, with DeepSpeed's signatures and defaults.

Each step: ``c = beta1 m + (1 - beta1) g``; ``p = p (1 - lr wd) - lr sign(c)``;
``m = beta2 m + (1 - beta2) g``. Lion is elementwise, so it steps the engine's flat
partitions exactly as it steps the parameters. Where ``c`` is 0, the parameter does not move;
DeepSpeed's kernel moves it by ``+lr`` there (its sign of 0 is -1), which a parameter whose
gradient and momentum are 0 (an embedding row no batch used) would drift by.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class FusedLion(torch.optim.Optimizer):
    """DeepSpeed's ``deepspeed.ops.lion.FusedLion`` (see the module's note); the config's
    ``"type": "Lion"`` builds it."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        if lr < 0:
            raise ValueError(f"{type(self).__name__}(lr=...): must be >= 0, got {lr!r}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{type(self).__name__}(betas=...): each in [0, 1), got {betas!r}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            moments = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                moments.append(state["exp_avg"])
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            if decay:
                torch._foreach_mul_(params, 1 - lr * decay)
            update = torch._foreach_lerp(moments, grads, 1 - beta1)  # beta1 m + (1 - beta1) g
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-lr)
            torch._foreach_lerp_(moments, grads, 1 - beta2)
        return loss


class DeepSpeedCPULion(FusedLion):
    """DeepSpeed's ``deepspeed.ops.lion.DeepSpeedCPULion``: the same optimizer (torch's ops run
    on whatever device the parameters are on); ``fp32_optimizer_states`` is taken."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states
