"""``deepspeed.utils.torch``: DeepSpeed's checks of the installed torch, which scripts and
DeepSpeed's own test models import (``required_torch_version``), and ``register_grad_hook``."""

from collections.abc import Callable
from typing import Any

import torch
from torch.torch_version import TorchVersion

__all__ = ["is_functorch_transforming", "register_grad_hook", "required_torch_version"]


def required_torch_version(
    min_version: float | str | None = None, max_version: float | str | None = None
) -> bool:
    """Whether the installed torch is at least `min_version` and at most `max_version` (each
    optional, one of them required), as DeepSpeed's compares them."""
    if not (min_version or max_version):
        raise ValueError("required_torch_version: give min_version or max_version")
    installed = TorchVersion(torch.__version__)
    if min_version and installed < str(min_version):
        return False
    return not (max_version and installed > str(max_version))


def is_functorch_transforming() -> bool:
    """Whether the caller runs under a torch.func transform (``grad``, ``vmap``, ...)."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
    """`hook(param)` once `param`'s gradient has been accumulated (torch's
    ``register_post_accumulate_grad_hook``, which every torch zstack supports has)."""
    return param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
