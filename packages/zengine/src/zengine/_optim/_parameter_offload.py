"""DeepSpeed's ``optimizer.parameter_offload`` at ZeRO stage 3: the owner of the modules' hooks.

Tools written against DeepSpeed reach its hooks there. TRL's generation at ZeRO-3 (GRPO, RLOO,
online DPO, GKD with ``ds3_gather_for_generation``) gathers every parameter, then clears each
parameter's ``ds_active_sub_modules``, removes the handles in ``forward_hooks`` and
``backward_hooks`` and empties both lists, generates token after token on the plain model, and
puts the hooks back with ``_register_deepspeed_module(module)``. Here one handle stands for all
of zpartition's forward hooks (removing it is `Partitioned.unhook_forward`), and the backward
list is empty: zpartition's backward work hangs off the forward hooks and off gradients, which
generation under ``no_grad`` never makes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

import zpartition

__all__ = ["ParameterOffload"]


class _ForwardHooks:
    """The handle that stands for every module's forward hooks."""

    def __init__(self, partitioned: zpartition.Partitioned) -> None:
        self._partitioned = partitioned

    def remove(self) -> None:
        self._partitioned.unhook_forward()


class ParameterOffload:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` as tools use it: `module`, `forward_hooks`,
    `backward_hooks` and ``_register_deepspeed_module``.

    The hook lists are views of the model's state: `forward_hooks` holds one handle while the
    hooks are on and none while they are off, however they were taken off (DeepSpeed's tests
    count them inside ``unwrap_model_for_generation``). Tools empty the lists after removing
    the handles; assigning is accepted and changes nothing, the removal having done the work."""

    def __init__(self, partitioned: zpartition.Partitioned) -> None:
        self._partitioned = partitioned
        self.module: nn.Module = partitioned.module

    @property
    def forward_hooks(self) -> list[Any]:
        return [_ForwardHooks(self._partitioned)] if self._partitioned.forward_hooked else []

    @forward_hooks.setter
    def forward_hooks(self, hooks: list[Any]) -> None:
        pass

    @property
    def backward_hooks(self) -> list[Any]:
        return []

    @backward_hooks.setter
    def backward_hooks(self, hooks: list[Any]) -> None:
        pass

    def _register_deepspeed_module(self, module: nn.Module, count: Any = None) -> None:
        """Put the hooks back on `module`, the partitioned model (DeepSpeed's recursive
        registration, whose `count` is its own bookkeeping)."""
        if module is not self.module:
            raise ValueError(
                "parameter_offload._register_deepspeed_module(module): zengine hooks the "
                f"partitioned model as a whole; got a {type(module).__name__}, not the model "
                f"({type(self.module).__name__})"
            )
        self._partitioned.hook_forward()
