"""A DeepSpeed checkpoint read by parameter name: any range of any parameter's fp32 master or
optimizer state, from whichever ranks' files hold it (where they lie: [Note: reading DeepSpeed's
layouts] in _ds_layout.py), and its frozen parameters, buffers, counters and client state.

A rank loading at another world size reads the extents overlapping its own pieces; the files
are mapped (``mmap``) and the pages given back as they are read, so a rank holds about one
parameter's bytes of them at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from zengine._checkpoint import _ds_files as ds_files
from zengine._checkpoint._ds_layout import (
    Param,
    groups_of_spaces,
    layout_stage0,
    layout_stage3,
    layout_stage12,
    layout_universal,
    shape_of,
)
from zengine._checkpoint._errors import CheckpointMismatchError, CorruptCheckpointError
from zengine._checkpoint._safe_load import Attributes, mappable, release

__all__ = ["MASTER", "DeepSpeedCheckpoint", "Readable", "read_key"]

MASTER = "fp32"  # DeepSpeed's (and the universal format's) name of the fp32 master
# what DeepSpeed's load_checkpoint keeps for itself; the rest of the file is the client's state
_OWN_KEYS = frozenset(
    {"module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size"}
    | {"data_sampler", "random_ltd", "lr_scheduler", "optimizer"}
)


def _optimizer_state(osd: dict[str, Any]) -> dict[str, Any]:
    """The file's torch optimizer state dict: ``base_optimizer_state`` (stages 1-2) or
    ``optimizer_state_dict`` (stage 3 and stage 0's wrappers)."""
    if "state" in osd:  # stage 0 in fp32: the torch optimizer's own state dict
        return osd
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    if isinstance(inner, list):  # elastic checkpoints: one state per group, no param_groups
        return {"state": dict(enumerate(inner)), "param_groups": osd.get("param_groups", [])}
    return inner or {"state": {}, "param_groups": []}


class DeepSpeedCheckpoint:
    """One tag of a DeepSpeed checkpoint (see [Note: reading DeepSpeed's layouts]).

    `group_names`: the names of the trainable parameters in each optimizer group, in the
    optimizer's order, for stage-0 checkpoints, which do not record them (the engine loading
    one knows them); without it a stage-0 checkpoint's masters are its module's weights.
    `mp_rank`: the model-parallel rank whose files to read (a pipeline's stage), with `module`
    the module state its model states file does not hold (a pipeline's layer files).
    """

    def __init__(
        self,
        directory: Path,
        group_names: Sequence[Sequence[str]] = (),
        *,
        mp_rank: int = 0,
        module: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.directory = directory
        self.universal = (directory / "zero" / "optimizer_state.pt").is_file()
        if ds_files.holds_experts(directory):
            raise CheckpointMismatchError(
                f"{directory} holds DeepSpeed's expert-parallel (MoE) files (expp_rank_* or "
                "*_expert_*): zstack has no expert parallelism (train MoE experts as ZeRO-3 "
                "leaf modules; see the compat package's README)"
            )
        if module is None and ds_files.pipeline_layer_files(directory):
            raise CheckpointMismatchError(
                f"{directory} was saved by DeepSpeed's pipeline engine (its layer_*.pt files): "
                "it loads into a zengine.pipe.PipelineEngine of the same layers, whose names "
                "for them only the pipeline knows (consolidate what that engine saves)"
            )
        model_files = ds_files.model_state_files(directory, mp_rank)
        if not model_files:
            raise CorruptCheckpointError(
                f"{directory}: a DeepSpeed checkpoint without its model states file "
                f"(mp_rank_{mp_rank:02d}_model_states.pt or "
                f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt)"
            )
        self._model_files = model_files
        self.model_states: dict[str, Any] = ds_files.load_deepspeed_file(model_files[0])
        if module is not None:  # a pipeline's: from its layer files
            self.model_states["module"] = module
        self._optim_files = ds_files.optim_state_files(directory, mp_rank)
        self._optim: dict[int, dict[str, Any]] = {}
        self._frozen_fragments: dict[int, dict[str, torch.Tensor]] = {}
        if self.universal:
            self._universal_state = ds_files.load_deepspeed_file(
                directory / "zero" / "optimizer_state.pt"
            )
            first = self._universal_state
        elif self._optim_files:
            first = self._osd(0)
        else:
            first = self.model_states.get("optimizer") or {}
        self.zero_stage = int(first.get("zero_stage", 0))
        self.world_size = int(self.model_states.get("dp_world_size", len(self._optim_files) or 1))
        if self._optim_files and len(self._optim_files) != self.world_size and not self.universal:
            raise CorruptCheckpointError(
                f"{directory}: {len(self._optim_files)} optimizer state files for the "
                f"{self.world_size} data-parallel ranks that saved it (a rank's file is missing)"
            )
        self._optimizer_head = self._head_state(first)
        self.params = self._layout(first, group_names)

    # -- the files ------------------------------------------------------------------------------

    def _osd(self, rank: int) -> dict[str, Any]:
        """Rank `rank`'s ``optimizer_state_dict`` (its optimizer file, loaded once, mapped)."""
        if rank not in self._optim:
            loaded = ds_files.load_deepspeed_file(self._optim_files[rank], mmap=True)
            self._optim[rank] = loaded["optimizer_state_dict"]
        return self._optim[rank]

    def _head_state(self, first: dict[str, Any]) -> dict[str, Any]:
        if self.universal:
            return dict(
                first.get("optimizer_state_dict") or {"param_groups": first["param_groups"]}
            )
        return _optimizer_state(first)

    # -- where each parameter lies --------------------------------------------------------------

    def _layout(
        self, first: dict[str, Any], group_names: Sequence[Sequence[str]]
    ) -> dict[str, Param]:
        shapes: list[dict[str, Any]] = self.model_states.get("param_shapes") or []
        groups = self._optimizer_head.get("param_groups") or []
        if self.universal:
            owner = groups_of_spaces(groups, len(shapes)) if self.zero_stage == 3 else None
            return layout_universal(shapes, owner)
        if self.zero_stage == 3:
            return layout_stage3(shapes, groups_of_spaces(groups, len(shapes)), self.world_size)
        if self.zero_stage in (1, 2):
            paddings = first.get("param_alignment_paddings") or [None] * len(shapes)
            fp32 = self._osd(0)["single_partition_of_fp32_groups"]
            return layout_stage12(shapes, paddings, [int(t.numel()) for t in fp32])
        return layout_stage0(group_names, self.model_states["module"], str(self._model_files[0]))

    # -- reading --------------------------------------------------------------------------------

    def _flat(self, rank: int, space: int, kind: str) -> list[torch.Tensor]:
        """Rank `rank`'s flat buffer `space` of `kind` (the master or an optimizer state), as
        consecutive pieces."""
        if self.zero_stage == 3:
            osd = self._osd(rank)
            if kind == MASTER:
                return list(osd["fp32_flat_groups"])
            state = _optimizer_state(osd)["state"]
            return [state[i][kind] for i in sorted(state)]
        if self.zero_stage in (1, 2):
            osd = self._osd(rank)
            if kind == MASTER:
                return [osd["single_partition_of_fp32_groups"][space]]
            return [_optimizer_state(osd)["state"][space][kind]]
        optimizer = self.model_states["optimizer"]
        if kind == MASTER:
            return [optimizer["fp32_groups_flat"][space]]
        return [_optimizer_state(optimizer)["state"][space][kind]]

    def _stage0_fp32(self) -> bool:
        optimizer = self.model_states.get("optimizer")
        return self.zero_stage == 0 and (optimizer is None or "fp32_groups_flat" not in optimizer)

    def _universal_file(self, name: str, kind: str) -> torch.Tensor:
        path = self.directory / "zero" / name / f"{kind}.pt"
        if not path.is_file():
            raise CorruptCheckpointError(f"{path} is missing (a universal checkpoint's {kind})")
        loaded = ds_files.load_deepspeed_file(path)
        tensor: torch.Tensor = loaded["param"] if isinstance(loaded, dict) else loaded
        return tensor.detach().reshape(-1)

    def _param_index(self, name: str) -> int:
        return list(self.params).index(name)

    def read(
        self, name: str, kind: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of parameter `name`'s flattened `kind` ("fp32" for the
        master, or an optimizer state such as "exp_avg"): written into `out` (1-D, any dtype)
        and returned, or as a new fp32 tensor."""
        param = self.params[name]
        if out is None:
            out = torch.empty(stop - start, dtype=torch.float32)
        if self.universal:
            out.copy_(self._universal_file(name, kind)[start:stop])
            return out
        if self._stage0_fp32():
            if kind == MASTER:
                whole = self.model_states["module"][name]
            else:
                state = _optimizer_state(self.model_states["optimizer"])["state"]
                held = state.get(self._param_index(name), {})  # none: it never had a gradient
                whole = held.get(kind, torch.zeros(param.numel))
            out.copy_(whole.reshape(-1)[start:stop])
            return out
        for extent in param.extents:
            lo = max(start, extent.param_offset)
            hi = min(stop, extent.param_offset + extent.length)
            if lo >= hi:
                continue
            at = extent.offset + lo - extent.param_offset
            pieces = self._flat(extent.rank, param.space, kind)
            _copy_from_pieces(pieces, at, out[lo - start : hi - start], self._mapped(extent.rank))
        return out

    def _mapped(self, rank: int) -> bool:
        """Whether rank `rank`'s flat buffers are views of a mapped file (stages 1-3)."""
        return self.zero_stage > 0 and mappable(self._optim_files[rank])

    def read_key(
        self, key: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """See `read_key`."""
        return read_key(self, key, start, stop, out)

    def state_kinds(self) -> list[str]:
        """The optimizer's per-element states (``exp_avg``, ``exp_avg_sq`` for Adam)."""
        if self.universal:
            first = next(iter(self.params), None)
            folder = self.directory / "zero" / first if first is not None else None
            if folder is None or not folder.is_dir():
                return []
            return sorted(p.stem for p in folder.glob("*.pt") if p.stem not in (MASTER, "step"))
        state = self._optimizer_head.get("state") or {}
        first_state: dict[str, Any] = next(iter(state.values()), {})
        return sorted(k for k, v in first_state.items() if isinstance(v, torch.Tensor) and v.dim())

    def step_of(self, name: str) -> int | None:
        """The optimizer's step count for parameter `name` (DeepSpeed's FusedAdam steps a group
        with the count of its last parameter's state: the largest); None if it never stepped."""
        param = self.params[name]
        if self.universal:
            path = self.directory / "zero" / name / "step.pt"
            if path.is_file():
                return int(ds_files.load_deepspeed_file(path))
        state = self._optimizer_head.get("state") or {}
        if self._stage0_fp32():
            state = _optimizer_state(self.model_states["optimizer"])["state"]
            names = [n for n, p in self.params.items() if p.group == param.group]
            steps = [state.get(self._param_index(n), {}).get("step") for n in names]
        else:
            groups = self._optimizer_head.get("param_groups") or []
            spaces = groups[param.group].get("params", []) if param.group < len(groups) else []
            steps = [state.get(s, {}).get("step") for s in spaces] or [
                s.get("step") for s in state.values()
            ]
        known = [int(s) for s in steps if s is not None]
        return max(known) if known else None

    # -- everything else ------------------------------------------------------------------------

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's group options (learning rate...), without DeepSpeed's own entries."""
        groups = self._optimizer_head.get("param_groups") or []
        if self.universal and not groups:
            groups = self._universal_state.get("param_groups", [])
        return [{k: v for k, v in g.items() if k not in ("params", "step")} for g in groups]

    def buffers(self) -> dict[str, torch.Tensor]:
        names = self.model_states.get("buffer_names") or []
        module = self.model_states.get("module") or {}
        return {n: module[n] for n in names if n in module}

    def frozen(self) -> dict[str, tuple[int, ...]]:
        """The parameters without optimizer state, and their shapes. Stages 0-2 do not always
        list them (ZeRO-1 does not), but their module state holds every parameter whole."""
        shapes = {
            n: shape_of(s) for n, s in (self.model_states.get("frozen_param_shapes") or {}).items()
        }
        if self.zero_stage < 3 and not self.universal:
            taken = self.params.keys() | self.buffers().keys() | self.shared().keys()
            for name, tensor in (self.model_states.get("module") or {}).items():
                if name not in taken and name not in shapes:
                    shapes[name] = shape_of(tensor.shape)
        return shapes

    def shared(self) -> dict[str, str]:
        """Tied parameters: another name -> the name saved. A stage-0 save does not record
        them, but its module state keeps them as views of one storage."""
        recorded = self.model_states.get("shared_params")
        if recorded is not None:
            return dict(recorded)
        first: dict[tuple[int, int, torch.Size], str] = {}
        shared = {}
        for name, tensor in (self.model_states.get("module") or {}).items():
            if not isinstance(tensor, torch.Tensor) or not tensor.numel():
                continue
            where = (
                tensor.untyped_storage().data_ptr(),
                int(tensor.storage_offset()),
                tensor.shape,
            )
            if where in first:
                shared[name] = first[where]
            else:
                first[where] = name
        return shared

    def frozen_tensor(self, name: str) -> torch.Tensor:
        """A frozen parameter, whole and flattened: stage 3 keeps a fragment on each rank."""
        if self.universal and (self.directory / "zero" / name / f"{MASTER}.pt").is_file():
            return self._universal_file(name, MASTER)
        # ds_to_universal leaves stage 3's frozen parameters out: its model states keep them
        if self.zero_stage != 3:
            fragments = self.model_states.get("frozen_param_fragments") or {}
            source: torch.Tensor | None = fragments.get(name, self.model_states["module"].get(name))
            if source is None:
                raise CorruptCheckpointError(
                    f"{self._model_files[0]}: no frozen parameter {name!r}"
                )
            return source.reshape(-1)
        numel = math.prod(self.frozen()[name])
        pieces = [self._frozen_fragments_of(r)[name].reshape(-1) for r in range(self.world_size)]
        return torch.cat(pieces)[:numel]

    def _frozen_fragments_of(self, rank: int) -> dict[str, torch.Tensor]:
        if rank not in self._frozen_fragments:
            loaded = ds_files.load_deepspeed_file(self._model_files[rank], mmap=True)
            self._frozen_fragments[rank] = loaded.get("frozen_param_fragments") or {}
        return self._frozen_fragments[rank]

    def module_tensor(self, name: str) -> torch.Tensor | None:
        """A parameter's weights as the module saved them (16-bit at stages 0-2 with fp16 or
        bf16; empty at stage 3)."""
        value = (self.model_states.get("module") or {}).get(name)
        return value if isinstance(value, torch.Tensor) and value.numel() else None

    def loss_scaler(self) -> dict[str, Any] | None:
        """The fp16 loss scaler's state, by DeepSpeed's attribute names; None without one."""
        if self.universal:
            scaler = self._universal_state.get("loss_scaler")
        elif self._optim_files:
            scaler = self._osd(0).get("loss_scaler")
        else:
            optimizer = self.model_states.get("optimizer") or {}
            return (
                {k: optimizer[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter")}
                | {"cur_hysteresis": optimizer.get("cur_hysteresis", 1)}
                if "cur_scale" in optimizer
                else None
            )
        return scaler.as_dict() if isinstance(scaler, Attributes) else None

    def client_state(self) -> dict[str, Any]:
        """What DeepSpeed's ``load_checkpoint`` returns as the client state: the model states
        file but DeepSpeed's own entries."""
        return {k: v for k, v in self.model_states.items() if k not in _OWN_KEYS}

    def counters(self) -> dict[str, int]:
        states = self.model_states
        return {
            "global_steps": int(states.get("global_steps", 0)),
            "global_samples": int(states.get("global_samples", 0)),
            "skipped_steps": int(states.get("skipped_steps", 0)),
        }

    def files(self) -> Iterator[Path]:
        yield from self._model_files
        yield from self._optim_files


class Readable(Protocol):
    """What `read_key` reads from: a checkpoint's parameters by name (one DeepSpeed save, or a
    pipeline's stages merged)."""

    @property
    def params(self) -> Mapping[str, Any]: ...

    def read(
        self, name: str, kind: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def buffers(self) -> dict[str, torch.Tensor]: ...

    def frozen(self) -> dict[str, tuple[int, ...]]: ...

    def frozen_tensor(self, name: str) -> torch.Tensor: ...

    def module_tensor(self, name: str) -> torch.Tensor | None: ...


def read_key(
    ck: Readable, key: str, start: int, stop: int, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Elements ``[start, stop)`` of the tensor zstack keeps under `key` (``master/<p>``,
    ``model/<p or buffer>``, ``optim/<p>/<state>``; see _state.py), written into `out` if given
    (and returned), or None when the checkpoint has none (a parameter only the model has, with
    ``load_module_strict=False``)."""
    kind, _, rest = key.partition("/")
    whole = None
    if kind == "master" and rest in ck.params:
        return ck.read(rest, MASTER, start, stop, out)
    if kind == "master":
        whole = ck.module_tensor(rest)  # stage 0 read without the optimizer's order
    elif kind == "model" and rest in ck.buffers():
        whole = ck.buffers()[rest]
    elif kind == "model" and rest in ck.frozen():
        whole = ck.frozen_tensor(rest)
    elif kind == "model" and rest in ck.params:  # trainable there, frozen here
        return ck.read(rest, MASTER, start, stop, out)
    elif kind == "optim" and rest.rpartition("/")[0] in ck.params:
        name, _, state = rest.rpartition("/")
        return ck.read(name, state, start, stop, out)
    if whole is None:
        return None
    piece = whole.reshape(-1)[start:stop]
    return piece if out is None else out.copy_(piece)


def _copy_from_pieces(
    pieces: list[torch.Tensor], at: int, out: torch.Tensor, mapped: bool = False
) -> None:
    """``out`` = elements ``[at, at + len(out))`` of the concatenation of `pieces`; the pages
    read are given back when the pieces are views of a `mapped` file."""
    done, base = 0, 0
    for piece in pieces:
        size = piece.numel()
        if done < out.numel() and at + done < base + size:
            lo = at + done - base
            n = min(size - lo, out.numel() - done)
            read = piece.reshape(-1)[lo : lo + n]
            out[done : done + n].copy_(read)
            if mapped:
                release(read)
            done += n
        base += size
    if done != out.numel():
        raise CorruptCheckpointError(
            f"a DeepSpeed flat buffer holds {base} elements, fewer than the parameters laid out "
            f"in it need ({at + out.numel()}): a file of another model?"
        )
