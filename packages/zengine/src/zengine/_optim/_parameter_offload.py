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
    `backward_hooks` and ``_register_deepspeed_module``."""

    def __init__(self, partitioned: zpartition.Partitioned) -> None:
        self._partitioned = partitioned
        self.module: nn.Module = partitioned.module
        self.forward_hooks: list[Any] = [_ForwardHooks(partitioned)]
        self.backward_hooks: list[Any] = []

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
        self.forward_hooks = [_ForwardHooks(self._partitioned)]
