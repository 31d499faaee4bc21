"""What DeepSpeed's universal checkpoint holds, as the plain data its loaders read.

[Note: DeepSpeed's universal checkpoint]
DeepSpeed's ``ds_to_universal`` turns a checkpoint into one folder per parameter, which
DeepSpeed loads at any world size and ZeRO stage with ``"checkpoint": {"load_universal":
true}`` (``engine.load_checkpoint`` reads ``latest_universal`` for the tag). Its loaders
(``runtime/engine.py`` ``_load_checkpoint``, ``runtime/base_optimizer.py``
``load_hp_checkpoint_state_from_checkpoint_dir`` at ZeRO 1-2 and bf16, ``runtime/zero/stage3.py``
``load_hp_checkpoint_state_from_checkpoint_dir_stage3``, ``checkpoint/universal_checkpoint.py``)
read, in DeepSpeed 0.19.8:

- ``zero/<param>/<state>.pt`` for every trainable parameter: ``{"param": tensor}`` of the whole
  parameter, fp32 (the master), and each optimizer state (``exp_avg``, ``exp_avg_sq``). ZeRO 1-2
  loads every ``.pt`` of the folder as a state of that name; ZeRO-3 reads ``fp32``, ``exp_avg``
  and ``exp_avg_sq`` by name. ``step.pt`` is a plain int: ZeRO 1-2 set it as the state's step
  (required: their Adam has no step of its own once the moments are loaded) and assert it is the
  same for every parameter of a group.
- ``zero/optimizer_state.pt``: ``ds_version`` (required; ZeRO-1 refuses one below 0.3.17) and
  ``param_groups``, whose options (all but ``params``) ZeRO 1-2 put into group i: their ``lr`` is
  the one DeepSpeed's first step after the load takes (its LR schedules' ``load_state_dict``
  restores the iteration only, and set the next rate after that step). ZeRO-3 reads
  ``optimizer_state_dict``: the step of all its tensors from ``state[0]["step"]``, and the options
  of ``param_groups[0]`` put into *every* group. So that a group keeps an option it does not
  share (the norm weights' ``weight_decay`` 0), those entries hold only the options all groups
  agree on; DeepSpeed keeps its own value for the others, from the groups its run was built with.
  ``loss_scaler``, ``dynamic_loss_scale``, ``overflow`` and ``clip_grad`` are read with ``get``:
  left out, DeepSpeed keeps its own (its loss scaler is an object of its classes, and its config
  decides the clipping).
- ``*_model_states.pt``: one file, found by a glob that depends on the *loading* run's stage
  (``mp_rank_*_model_states.pt`` at ZeRO 0-2, ``zero_pp_rank_0_mp_rank_*_model_states.pt`` at
  ZeRO-3), so both are written, the same dict. ``mp_world_size`` must be 1 (the file count);
  ``lr_scheduler``, ``global_steps``, ``skipped_steps`` (and ``global_samples``) are loaded; every
  key that is not DeepSpeed's own comes back as the client state. ``module`` is not loaded in
  universal mode: it holds the buffers, and each parameter as an empty tensor as DeepSpeed's
  ZeRO-3 writes it; the weights are under ``zero/``.

DeepSpeed restores neither buffers nor frozen parameters from a universal checkpoint (they stay
as its run built them); frozen parameters are written to ``zero/<name>/fp32.pt`` all the same,
as ``ds_to_universal`` does at ZeRO 0-2, so the folder holds the whole model.
"""

from __future__ import annotations

from typing import Any

import torch

from zengine._checkpoint._errors import CheckpointError

__all__ = [
    "DS_VERSION",
    "LATEST_UNIVERSAL",
    "MODEL_STATES",
    "OPTIMIZER_STATE",
    "ZERO",
    "check_plain",
    "model_states",
    "optimizer_state",
    "param_file",
]

DS_VERSION = "0.19.8"  # the DeepSpeed release whose layout this is
LATEST_UNIVERSAL = "latest_universal"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")

# torch's switches for how a step runs, not what it computes: DeepSpeed's FusedAdam ignores
# them, and an optimizer of another class may refuse them (``fused`` on a device it lacks)
_IMPLEMENTATION = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


def param_file(tensor: torch.Tensor) -> dict[str, Any]:
    """A parameter's ``zero/<name>/<state>.pt``: the whole tensor, as ``ds_to_universal`` writes
    it (``cat_dim`` is the dimension tensor-parallel slices were joined on: none here)."""
    return {"param": tensor, "cat_dim": 0}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return type(a) is type(b) and bool(a == b)


def optimizer_state(groups: list[dict[str, Any]], step: int | None) -> dict[str, Any]:
    """``zero/optimizer_state.pt`` from the torch optimizer's group options and the step count
    (None: no step taken yet)."""
    options = [{k: v for k, v in g.items() if k not in _IMPLEMENTATION} for g in groups]
    shared = {
        k: v
        for k, v in (options[0] if options else {}).items()
        if all(k in o and _same(o[k], v) for o in options[1:])
    }
    return {
        "ds_version": DS_VERSION,
        "param_groups": options,
        "optimizer_state_dict": {
            "state": {0: {"step": step}} if step is not None else {},
            "param_groups": [dict(shared) for _ in options],  # a group each, as DeepSpeed's
        },
    }


def model_states(
    manifest: dict[str, Any],
    engine: dict[str, Any],
    buffers: dict[str, torch.Tensor],
    client_state: dict[str, Any],
) -> dict[str, Any]:
    """The ``*_model_states.pt`` dict from a zengine checkpoint's manifest, its ``engine``
    entry (counters and LR scheduler) and buffers; `client_state` goes in last, as DeepSpeed's
    save puts it (its keys come back from DeepSpeed's load as the client state)."""
    params = manifest["params"]
    shapes: list[dict[str, torch.Size]] = [{} for _ in range(int(manifest["param_groups"]))]
    for name, info in params.items():
        if info["group"] is not None:
            shapes[info["group"]][name] = torch.Size(info["shape"])
    module: dict[str, torch.Tensor] = {}
    for name, info in params.items():
        module[name] = torch.empty(0, dtype=getattr(torch, info["dtype"]))
    for other, name in manifest.get("shared", {}).items():
        module[other] = module[name]
    module.update(buffers)
    state = {
        "module": module,
        "buffer_names": list(buffers),
        "optimizer": None,
        "param_shapes": shapes,
        "frozen_param_shapes": {
            n: torch.Size(i["shape"]) for n, i in params.items() if i["group"] is None
        },
        "shared_params": dict(manifest.get("shared", {})),
        "frozen_param_fragments": None,  # the frozen weights are under zero/
        "lr_scheduler": engine["lr_scheduler"],
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(engine["skipped_steps"]),
        "global_steps": int(engine["global_steps"]),
        "global_samples": int(engine["global_samples"]),
        "dp_world_size": int(manifest["world_size"]),
        "mp_world_size": 1,  # DeepSpeed asserts it equals the number of model-states files
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_version": DS_VERSION,
    }
    check_plain(state, "model states")
    state.update(client_state)
    return state


_LEAVES = (type(None), bool, int, float, str, torch.Tensor, torch.Size)


def check_plain(value: Any, where: str) -> None:
    """Raise unless `value` is plain data (tensors, numbers, strings, None, and lists, tuples and
    dicts of them): DeepSpeed's files are read by a DeepSpeed that has none of our classes."""
    if isinstance(value, _LEAVES):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise CheckpointError(f"{where}: key {key!r} is a {type(key).__name__}")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}: DeepSpeed's universal "
        "checkpoint is written as plain data only (tensors, numbers, strings, lists, dicts)"
    )
