"""The backward split in two for zero-bubble schedules: input gradients now, weights later.

[Note: splitting the backward]
BackwardInputPass runs autograd towards the stage's inputs only. Autograd then skips the
weight-gradient products of every node (they lead to no requested input), so this half costs
about what computing the input gradients alone costs. Each node on the input path that also
feeds a weight (a linear layer's addmm, a layer norm) gets a pre-hook that keeps the gradient
flowing into it. BackwardWeightPass restarts autograd at each such node with the kept
gradient, asking only for the weights below it: the node recomputes just its weight part.
That is exact when no weight hangs below two such nodes; otherwise (a weight used twice
within the stage) restarting would count the shared part twice, so the weight pass falls
back to a second full backward towards the weights, which is exact but costs more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["SplitBackward"]


def _node(tensor: torch.Tensor) -> Node:
    return get_gradient_edge(tensor).node


def _post_order(roots: Sequence[Node]) -> list[Node]:
    """Every node reachable from `roots`, each after all nodes below it."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None)
    return order


@dataclass
class _WeightWork:
    """Where the weight pass restarts: a node and the gradient that flowed into it."""

    node: Node
    weights: list[nn.Parameter]
    grads: tuple[torch.Tensor | None, ...] = field(default=())


class SplitBackward:
    """The two halves of one micro-batch's backward on one stage (see the Note above)."""

    def __init__(
        self,
        outputs: list[torch.Tensor],
        grads: list[torch.Tensor],
        inputs: list[torch.Tensor],
        params: list[nn.Parameter],
    ) -> None:
        self.outputs = outputs  # the graph lives as long as these
        self.grads = grads
        self.inputs = inputs
        self.params = params
        self._work: list[_WeightWork] = []
        self._roots: list[tuple[torch.Tensor, torch.Tensor, list[nn.Parameter]]] = []
        self._fallback = False

    def input_pass(self) -> list[torch.Tensor | None]:
        """The gradients of the inputs; the weight gradients are left for `weight_pass`."""
        if not self.inputs:
            return []
        self._plan()
        handles = [w.node.register_prehook(self._keeper(w)) for w in self._work]
        try:
            found = torch.autograd.grad(
                self.outputs, self.inputs, self.grads, retain_graph=True, allow_unused=True
            )
        finally:
            for handle in handles:
                handle.remove()
        return list(found)

    @staticmethod
    def _keeper(work: _WeightWork) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            work.grads = grad_outputs

        return keep

    def weight_pass(self) -> None:
        """Accumulate the weight gradients into ``.grad``, then let the graph go."""
        if not self.inputs or self._fallback:
            wanted = [p for p in self.params if p.requires_grad]
            torch.autograd.backward(self.outputs, self.grads, inputs=wanted or None)
        else:
            for work in self._work:
                kept = [(i, g) for i, g in enumerate(work.grads) if g is not None]
                if kept:
                    edges = [GradientEdge(work.node, i) for i, _ in kept]
                    self._accumulate(work.weights, edges, [g for _, g in kept])
            for output, grad, weights in self._roots:
                self._accumulate(weights, [output], [grad])
        self.outputs, self.grads, self.inputs = [], [], []
        self._work, self._roots = [], []

    @staticmethod
    def _accumulate(
        weights: list[nn.Parameter],
        roots: Sequence[torch.Tensor] | Sequence[GradientEdge],
        grads: list[torch.Tensor],
    ) -> None:
        found = torch.autograd.grad(roots, weights, grads, retain_graph=True, allow_unused=True)
        # autograd.grad's annotation says Tensor, but allow_unused gives None for a weight
        # this root does not reach
        maybe: tuple[torch.Tensor | None, ...] = found
        for weight, grad in zip(weights, maybe, strict=True):
            if grad is None:
                continue
            if weight.grad is None:
                weight.grad = grad
            else:
                weight.grad.add_(grad)

    def _plan(self) -> None:
        """Find the nodes where the weight pass restarts (and whether it can)."""
        input_nodes = {_node(x) for x in self.inputs}
        weight_of = {_node(p): p for p in self.params if p.requires_grad}
        roots = [_node(out) for out in self.outputs]
        order = _post_order(roots)
        to_input: dict[Node, bool] = {}
        to_weight: dict[Node, bool] = {}
        for node in order:
            children = [c for c, _ in node.next_functions if c is not None]
            to_input[node] = node in input_nodes or any(to_input[c] for c in children)
            to_weight[node] = node in weight_of or any(to_weight[c] for c in children)
        owners: dict[nn.Parameter, int] = {}
        for node in order:
            if not to_input[node] or node in input_nodes:
                continue
            below = [c for c, _ in node.next_functions if c is not None and not to_input[c]]
            weights = self._weights_below([c for c in below if to_weight[c]], weight_of)
            if weights:
                self._work.append(_WeightWork(node, weights))
                for w in weights:
                    owners[w] = owners.get(w, 0) + 1
        for output, grad, root in zip(self.outputs, self.grads, roots, strict=True):
            if not to_input[root] and to_weight[root]:
                weights = self._weights_below([root], weight_of)
                self._roots.append((output, grad, weights))
                for w in weights:
                    owners[w] = owners.get(w, 0) + 1
        self._fallback = any(count > 1 for count in owners.values())

    @staticmethod
    def _weights_below(
        starts: list[Node], weight_of: dict[Node, nn.Parameter]
    ) -> list[nn.Parameter]:
        found: list[nn.Parameter] = []
        for node in _post_order(starts):
            if node in weight_of:
                found.append(weight_of[node])
        return found
