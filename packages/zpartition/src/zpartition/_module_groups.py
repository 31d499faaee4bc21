"""Module groups: the small modules under one parent gathered as one unit, chosen by size.

[Note: module groups]
A unit per module costs the same hook work however small the module: a fetch and a release in
forward, again in backward, a grad_fn hook and the gradients' bookkeeping. For a block of six
small layers that is six times the Python of one fetch, and at a few hundred modules it is
most of a step's overhead over plain data parallelism. FSDP2 asks the user to call
``fully_shard`` per block; DeepSpeed gathers per module unless the user marks leaves (or sets
``stage3_module_granularity_threshold``). Here a module whose children are all layers without
children of their own (Linear, LayerNorm, ...), whose subtree holds at most
``module_group_size`` partitioned elements (persistent parameters not counted), and in which
more than one module holds such parameters, is a *group*: the outermost one, walking from the
root. It is gathered whole, as a leaf module is: one unit, hooks on it alone (see [Note:
hooks]). A transformer block's attention and MLP are groups; a block holding those is not, nor
is anything deeper: the modules a group hides are plain layers, called by their parent, which
is what a unit per module would gather one by one (DeepSpeed's own tests inspect where a
parameter returned from a nested module is registered, and that stays as it was).

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
    """The modules of `root` gathered as one unit each: the outermost ones whose children have
    no children and whose subtree holds at most `limit` partitioned elements outside
    `persistent_ids`, in more than one module."""
    chosen: set[nn.Module] = set()
    if limit <= 0:
        return chosen

    def visit(module: nn.Module, is_root: bool) -> None:
        if z3_leaf_module(module):
            return  # a leaf already is gathered whole
        if (
            not is_root
            and not is_container(module)
            and all(next(child.children(), None) is None for child in module.children())
            and _fits(module, limit, persistent_ids)
        ):
            chosen.add(module)
            return
        for child in module.children():
            visit(child, False)

    visit(root, True)
    return chosen


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
