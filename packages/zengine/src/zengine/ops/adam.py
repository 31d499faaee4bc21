"""DeepSpeed's ``FusedAdam`` and ``DeepSpeedCPUAdam``: torch's Adam with DeepSpeed's signatures.

DeepSpeed builds both from its own CUDA and C++ kernels; torch's fused Adam is the same
algorithm on CPU and CUDA, so here they are `torch.optim.Adam` (its fused kernel where the
parameters allow it, else its multi-tensor loop), with DeepSpeed's arguments:

- ``adam_w_mode`` / ``adamw_mode`` (default True): weight decay decoupled from the gradient
  (AdamW), else added to it (L2, Adam);
- ``bias_correction=False``: the moments are used without Adam's bias correction (each step
  runs with the learning rate and epsilon that cancel torch's correction);
- ``amsgrad``: refused by ``FusedAdam``, as DeepSpeed refuses it; ``DeepSpeedCPUAdam`` takes it;
- ``set_grad_none`` and ``fp32_optimizer_states``: taken (``zero_grad`` sets gradients to None
  by default; under the engine the states follow the fp32 masters).

Passed to ``zengine.initialize(optimizer=...)``, they step the engine's fp32 masters (on the
host with ``offload_optimizer``), as every optimizer given there does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class _DeepSpeedAdam(torch.optim.Adam):
    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        bias_correction: bool,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        amsgrad: bool,
        decoupled: bool,
    ) -> None:
        params = list(params)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled_weight_decay=decoupled,
            fused=_fusable(params),
        )
        self.defaults["bias_correction"] = bias_correction
        for group in self.param_groups:
            group.setdefault("bias_correction", bias_correction)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Adam step; groups without bias correction step with the learning rate and
        epsilon that undo torch's (and the weight decay that keeps lr x decay)."""
        saved = [_uncorrect(group, self.state) for group in self.param_groups]
        try:
            return super().step(closure)  # type: ignore[no-any-return]
        finally:
            for group, kept in zip(self.param_groups, saved, strict=True):
                if kept is not None:
                    group["lr"], group["eps"], group["weight_decay"] = kept


def _uncorrect(
    group: dict[str, Any], state: dict[torch.Tensor, Any]
) -> tuple[float, float, float] | None:
    """Set `group` for a step without bias correction; its lr, eps and weight decay as they
    were (None when it keeps the correction). torch's step with bias corrections c1 and c2 is
    ``lr (m / c1) / (sqrt(v / c2) + eps)``: with ``lr' = lr c1 / sqrt(c2)`` and
    ``eps' = eps / sqrt(c2)`` it is ``lr m / (sqrt(v) + eps)``."""
    if group.get("bias_correction", True) or not group["params"]:
        return None
    step = next((state[p]["step"] for p in group["params"] if p in state), None)
    t = 1 + (int(step) if step is not None else 0)
    beta1, beta2 = group["betas"]
    c1, root_c2 = 1 - beta1**t, (1 - beta2**t) ** 0.5
    kept = (group["lr"], group["eps"], group["weight_decay"])
    lr, eps, decay = kept
    group["lr"] = lr * c1 / root_c2
    group["eps"] = eps / root_c2
    if group["decoupled_weight_decay"]:
        group["weight_decay"] = decay * lr / group["lr"]  # torch decays by lr' x decay'
    return kept


def _fusable(params: list[Any]) -> bool:
    """Whether torch's fused Adam takes `params` (floating point, on CPU or CUDA)."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return all(
        isinstance(t, torch.Tensor) and t.device.type in ("cpu", "cuda") and t.is_floating_point()
        for t in tensors
    )


class FusedAdam(_DeepSpeedAdam):
    """DeepSpeed's ``deepspeed.ops.adam.FusedAdam`` (see the module's note)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (as DeepSpeed's)")
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            decoupled=adam_w_mode,
        )
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """DeepSpeed's ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (see the module's note)."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled=adamw_mode,
        )
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
