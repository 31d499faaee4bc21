"""`LayerSpec` and `TiedLayerSpec`: layers described, built only on the stage that owns them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["LayerSpec", "TiedLayerSpec"]


class LayerSpec:
    """``LayerSpec(cls, *args, **kwargs)``: a layer to build later as ``cls(*args, **kwargs)``.

    A PipelineModule builds a spec only on the stage it is partitioned to, so no rank ever
    holds the whole model.
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(
                f"LayerSpec: expected an nn.Module subclass, got {typename!r}; pass a "
                "built module or a callable to PipelineModule directly instead"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        """Build the layer."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights (`tied_weight_attr`) are one set across every stage holding `key`.

    Each stage that owns a layer with this key builds the module once; the weights start
    equal (copied from the lowest such stage), and their gradients are all-reduced across
    those stages in ``ReduceTiedGrads``, so they stay equal. `forward_fn(module, x)`, when
    given, replaces ``module(x)`` (a head that reuses an embedding's weight).
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr
        self.tied_weight_attr = list(attrs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.key!r}, {self.typename.__name__})"
