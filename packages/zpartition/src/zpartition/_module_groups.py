"""Module groups: the small modules under one parent gathered as one unit, chosen by size.

[Note: module groups]
A unit per module costs the same hook work however small the module: a fetch and a release in
forward, again in backward, a grad_fn hook and the gradients' bookkeeping. For a block of six
small layers that is six times the Python of one fetch, and at a few hundred modules it is
most of a step's overhead over plain data parallelism. FSDP2 asks the user to call
``fully_shard`` per block; DeepSpeed gathers per module unless the user marks leaves (or sets
``stage3_module_granularity_threshold``). Here a module is a *group* when its subtree holds
at most ``module_group_size`` partitioned elements (persistent parameters not counted), more
than one of its modules holds such parameters, and it is a *block*; the outermost one, walking
from the root. A block hides only *layers* and *wrappers*, at any depth:
- a layer is a module whose children hold no parameters (Linear, LayerNorm; a fused MoE's
  experts, whose one child is its activation), or a leaf the user marked;
- a wrapper holds no parameters of its own (a Llama layer's attention and MLP, a T5 block's
  ``ModuleList`` of sublayers, a LoRA layer and its ``ModuleDict`` of adapters);
and it holds no *stack*: a container (``ModuleList``, ``Sequential``, ``ModuleDict``) with two
or more alike children (one class, and one class for each child of theirs, by name) that each
hold parameters in more than one module, as a model's list of decoder layers (T5's first
block, which alone holds the relative position bias, is alike the others by this measure).
So a Llama or GPT-2 decoder layer, the same layer under PEFT's LoRA, a T5 block and a Mixtral
or Qwen2-MoE decoder layer (Transformers 5's fused experts) are each one group, and the model
above them, whose layers form a stack, is not. The first rule reached two levels down, through
wrappers that were not containers: LoRA's adapters, T5's sublayers and the experts' activation
kept those models a unit per module or per sublayer, 2-5 units per decoder layer. The stack is
what keeps a group to a block: without it a small model's whole body would fit in one group,
and its gathers, one unit, could no longer overlap the layers' compute. A MoE block whose
experts are a list of alike modules is a stack, so each expert is a group of its own (mark the
MoE block a leaf to gather it whole, as DeepSpeed advises). A group is gathered whole, as a
leaf module is: hooks on it alone (see [Note: hooks]), one unit (two with frozen parameters,
below). A module that holds parameters itself and has children with parameters is neither a
layer nor a wrapper, so it is never hidden in a group: DeepSpeed's own tests inspect where a
parameter returned from such a nested module is registered, and that stays as it was.

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
- A group's (and a leaf's) frozen parameters form a unit of their own, its trainable ones
  another, fetched together. A unit's backward is over when its last gradient arrives; in a
  group whose frozen layers sit beside trainable ones (a LoRA layer's base beside its
  adapters) the frozen layers' backward may still be to come then, so their unit is released
  at the end of the backward, as a frozen module's is. With ``quantized_nontrainable_weights``
  the frozen unit can be kept as codes ([Note: quantized frozen weights]).
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
    """The modules of `root` gathered as one unit each: the outermost blocks whose subtree holds
    at most `limit` partitioned elements outside `persistent_ids`, in more than one module
    ([Note: module groups])."""
    chosen: set[nn.Module] = set()
    if limit <= 0:
        return chosen

    def visit(module: nn.Module, is_root: bool) -> None:
        if z3_leaf_module(module):
            return  # a leaf already is gathered whole
        if (
            not is_root
            and not is_container(module)
            and _block(module)
            and _fits(module, limit, persistent_ids)
        ):
            chosen.add(module)
            return
        for child in module.children():
            visit(child, False)

    visit(root, True)
    return chosen


def _block(module: nn.Module) -> bool:
    """Whether every module below `module` is a layer or a wrapper and no container in its
    subtree is a stack ([Note: module groups])."""
    below = list(module.children())
    while below:
        m = below.pop()
        if _layer(m):
            continue
        if next(m.parameters(recurse=False), None) is not None:
            return False  # parameters of its own and children with parameters
        if is_container(m) and _stack(m):
            return False
        below.extend(m.children())
    return True


def _layer(module: nn.Module) -> bool:
    """A leaf the user marked, or a module whose children hold no parameters."""
    return z3_leaf_module(module) or all(
        next(child.parameters(), None) is None for child in module.children()
    )


def _stack(container: nn.Module) -> bool:
    """Whether two or more of `container`'s children are alike (one class, and one class for
    each of their children, by name) and each hold parameters in more than one module: a list
    of blocks, not a block's list of parts (T5's self-attention and feed-forward, or one
    wrapper class around each: what they wrap differs)."""
    seen: set[tuple[object, ...]] = set()
    for child in container.children():
        owners = sum(next(m.parameters(recurse=False), None) is not None for m in child.modules())
        if owners < 2:
            continue
        kind = (type(child), *((name, type(m)) for name, m in child.named_children()))
        if kind in seen:
            return True
        seen.add(kind)
    return False


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
