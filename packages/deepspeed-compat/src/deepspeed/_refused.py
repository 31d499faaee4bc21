"""Names DeepSpeed has and zstack does not honour: importable, so the libraries that import them
at module level still load, and raising at the call with the feature and zstack's alternative."""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["Refused", "UnsupportedFeatureError", "refused"]


class UnsupportedFeatureError(RuntimeError):
    """A DeepSpeed feature zstack does not provide, raised where it is called."""


class Refused:
    """A stand-in for one of DeepSpeed's functions or classes that zstack does not honour.

    Calling it, or reading an attribute of it (``UlyssesSPAttentionHF.register_with_transformers``),
    raises `UnsupportedFeatureError` naming the feature and what to use instead."""

    __zstack_refused__ = True

    def __init__(self, name: str, feature: str, alternative: str) -> None:
        self.__name__ = self.__qualname__ = name.rsplit(".", 1)[-1]
        self.__doc__ = f"Refused by zstack: {feature}. {alternative}"
        self._message = (
            f"{name}: {feature} is not part of zstack (the `deepspeed` installed here is "
            f"zstack's compatibility package). {alternative}"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        del args, kwargs
        raise UnsupportedFeatureError(self._message)

    def __getattr__(self, attribute: str) -> NoReturn:
        if attribute.startswith("__"):  # copy, pickle and inspect probe for these
            raise AttributeError(attribute)
        raise UnsupportedFeatureError(self._message)

    def __repr__(self) -> str:
        return f"<refused {self.__name__}>"


def refused(name: str, feature: str, alternative: str) -> Refused:
    """The stand-in for DeepSpeed's `name`."""
    return Refused(name, feature, alternative)


TENSOR_PARALLEL = (
    "tensor parallelism (AutoTP)",
    "Shard the model with ZeRO-3 (zero_optimization.stage 3) instead, or apply "
    "torch.distributed.tensor.parallel to the model yourself.",
)
SEQUENCE_PARALLEL = (
    "sequence parallelism (Ulysses)",
    "Train with shorter sequences per rank, or with activation checkpointing "
    "(zengine.checkpointing) to fit long ones.",
)
EXPERT_PARALLEL = (
    "expert parallelism (deepspeed.moe groups)",
    "Mixture-of-experts models train under ZeRO-3 with their experts as leaf modules "
    "(deepspeed.utils.set_z3_leaf_modules), every expert sharded like any other weight.",
)
