"""DeepSpeed's offload enums, with the same names and string values.

Both are ``str`` enums, so a config value ``"cpu"`` compares equal to
``OffloadDeviceEnum.cpu`` and ``OffloadDeviceEnum("nvme")`` parses one.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, Enum):
    """Where offloaded bytes go: ``none`` (dropped, not kept), ``cpu`` (host memory), ``nvme``."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"

    def __str__(self) -> str:
        return self.value


class OffloadStateTypeEnum(str, Enum):
    """The five groups of ZeRO training state that ``engine.offload_states`` can move."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"

    def __str__(self) -> str:
        return self.value
