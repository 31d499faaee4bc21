"""Module groups: the small modules under one parent gathered as one unit, chosen by size.

[Note: module groups]
A unit per module costs the same hook work however small the module: a fetch and a release in
forward, again in backward, a grad_fn hook and the gradients' bookkeeping. For a block of six
small layers that is six times the Python of one fetch, and at a few hundred modules it is
most of a step's overhead over plain data parallelism. FSDP2 asks the user to call
``fully_shard`` per block; DeepSpeed gathers per module unless the user marks leaves (or sets
``stage3_module_granularity_threshold``). Here a module is a *group* when it is *shallow*, its
subtree holds at most ``module_group_size`` partitioned elements (persistent parameters not
counted), and more than one of its modules holds such parameters; the outermost one, walking
from the root. Shallow: each child is a layer without children (Linear, LayerNorm, ...), or a
module without parameters of its own whose children are such layers (a transformer block's
attention and MLP). A group is gathered whole, as a leaf module is: one unit, hooks on it alone
(see [Note: hooks]). A Llama or GPT-2 decoder layer is one group; a module that holds
parameters itself and has children, one level down, is not hidden in a group: DeepSpeed's own
tests inspect where a parameter returned from such a nested module is registered, and that
stays as it was.

What stays as it was with a unit per module:
- A submodule called outside its group's forward, or a parameter read from another module,
  is still gathered: every module of a group keeps the parameter dict that notices a read by
  a module not running it (`_external.py`), and the reader
  registers the parameter with the module that runs, as it always has.
- External parameters registered on a module inside a group are gathered with the group.
- The live-parameter limit: a group is at most half of ``max_live_parameters`` elements, as
  two groups meet in a backward (one ending, the next beginning).
- Leaf modules the user marked stay leaves (a group may hold them); containers
  (``ModuleList``, ``Sequential``) and the root are never groups: a container's forward may
  never run, and the root begins every pass.
- With ``quantized_nontrainable_weights`` a group's frozen parameters form a unit of their own,
  so that they can be kept as codes ([Note: quantized frozen weights]).
What changes: a group's parameters are gathered from its first module's forward to its last,
not module by module, so a group's elements are live at once, at most ``module_group_size``
of them; 0 turns groups off.
"""

from __future__ import annotations

from torch import nn

from zpartition._leaf import is_container, z3_leaf_module
from zpartition._param import partitioned

__all__ = ["module_groups"]


def module_groups(root: nn.Module, limit: int, persistent_ids: set[int]) -> set[nn.Module]:
    """The modules of `root` gathered as one unit each: the outermost shallow ones whose subtree
    holds at most `limit` partitioned elements outside `persistent_ids`, in more than one
    module ([Note: module groups])."""
    chosen: set[nn.Module] = set()
    if limit <= 0:
        return chosen

    def visit(module: nn.Module, is_root: bool) -> None:
        if z3_leaf_module(module):
            return  # a leaf already is gathered whole
        if (
            not is_root
            and not is_container(module)
            and _shallow(module)
            and _fits(module, limit, persistent_ids)
        ):
            chosen.add(module)
            return
        for child in module.children():
            visit(child, False)

    visit(root, True)
    return chosen


def _shallow(module: nn.Module) -> bool:
    """Each child of `module` is a layer without children, or a module that holds no parameter
    of its own (not a container) whose children are such layers."""
    for child in module.children():
        grandchildren = list(child.children())
        if not grandchildren:
            continue
        if is_container(child) or next(child.parameters(recurse=False), None) is not None:
            return False
        if any(next(g.children(), None) is not None for g in grandchildren):
            return False
    return True


def _fits(module: nn.Module, limit: int, persistent_ids: set[int]) -> bool:
    """Whether `module`'s subtree holds at most `limit` partitioned elements, in at least two
    modules (one module alone is a unit already)."""
    numel, owners, seen = 0, 0, set()
    for m in module.modules():
        owns = False
        for p in partitioned(m.parameters(recurse=False)):
            if p.ds_id in persistent_ids or p.ds_id in seen:
                continue
            seen.add(p.ds_id)
            numel += int(p.ds_numel)
            owns = True
            if numel > limit:
                return False
        owners += owns
    return owners > 1
