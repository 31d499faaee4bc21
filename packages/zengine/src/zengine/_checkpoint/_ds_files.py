"""DeepSpeed's checkpoint folders on disk: which files a tag holds, and reading them safely.

A DeepSpeed save of tag T under a save_dir writes ``save_dir/latest`` (the newest tag) and, in
``save_dir/T``:

- ``mp_rank_00_model_states.pt`` (ZeRO stages 0-2: rank 0's) or one
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per data-parallel rank (stage 3): the module's
  state dict (16-bit weights at stages 0-2, empty ones at stage 3, buffers), the parameter
  shapes per optimizer group, frozen parameters, tied names, the LR scheduler, the step
  counters, the config and the user's ``client_state`` (its keys beside DeepSpeed's);
- ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (stages 1-3): rank r's partition of the
  fp32 masters and of the optimizer state, and the loss scaler;
- ``layer_<NN>-model_states.pt`` (the pipeline engine): one layer's state dict each.

``ds_to_universal`` writes a *universal* folder instead: ``zero/<param>/{fp32,exp_avg,...}.pt``,
each a whole parameter, ``zero/optimizer_state.pt``, and the model states; ``latest_universal``
names it.

The files are torch pickles that name three DeepSpeed classes (the loss scalers, the ZeRO stage
enum, a fragment's address); they load here through `load_file` with stand-ins for those,
without DeepSpeed installed and without running anything from the file.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zengine._checkpoint._safe_load import load_file, stand_in

__all__ = [
    "LATEST",
    "LATEST_UNIVERSAL",
    "expert_optim_name",
    "holds_experts",
    "is_deepspeed",
    "load_deepspeed_file",
    "model_parallel_ranks",
    "model_state_files",
    "optim_state_files",
    "pipeline_layer_files",
    "resolve_deepspeed",
]

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"

_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_LAYER = re.compile(r"layer_(\d+)-model_(?:\d+-)?states\.pt")


def _zero_stage(value: int) -> int:
    """DeepSpeed's ``ZeroStageEnum`` pickles as the enum called with its value: its stage."""
    return int(value)


# DeepSpeed's classes its checkpoint files name, and what stands for each here
_ALLOWED: dict[str, Callable[..., Any]] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": stand_in(
        "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    ),
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": stand_in(
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    ),
    "deepspeed.utils.tensor_fragment.fragment_address": stand_in(
        "deepspeed.utils.tensor_fragment.fragment_address"
    ),
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
}


def load_deepspeed_file(path: Path, *, mmap: bool = False) -> Any:
    """One of DeepSpeed's checkpoint files, read without running code (see the module doc)."""
    return load_file(path, _ALLOWED, mmap=mmap)


def _ranked(directory: Path, pattern: re.Pattern[str]) -> list[tuple[int, int, Path]]:
    found = []
    for path in directory.iterdir():
        match = pattern.fullmatch(path.name)
        if match:
            dp, mp = match.group(1), match.group(2)
            found.append((int(dp) if dp is not None else 0, int(mp), path))
    return sorted(found)


def expert_optim_name(directory: Path, expp_rank: int, mp_rank: int = 0) -> Path:
    """Where DeepSpeed keeps the optimizer state of expert-parallel rank `expp_rank` of an MoE
    model outside ZeRO (its ``_get_optimizer_ckpt_name``)."""
    return directory / f"expp_rank_{expp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def holds_experts(directory: Path) -> bool:
    """Whether `directory` holds DeepSpeed's expert-parallel (MoE) files, which zstack, with no
    expert parallelism, does not read."""
    return any(directory.glob("expp_rank_*_optim_states.pt")) or any(
        directory.glob("*expert_*_model_states.pt")
    )


def model_state_files(directory: Path, mp_rank: int = 0) -> list[Path]:
    """The model-state files of model-parallel rank `mp_rank` (a pipeline's stage), by
    data-parallel rank."""
    return [p for _, mp, p in _ranked(directory, _MODEL) if mp == mp_rank]


def optim_state_files(directory: Path, mp_rank: int = 0) -> list[Path]:
    """The optimizer-state files of model-parallel rank `mp_rank`, by data-parallel rank."""
    return [p for _, mp, p in _ranked(directory, _OPTIM) if mp == mp_rank]


def model_parallel_ranks(directory: Path) -> int:
    """How many model-parallel ranks (a pipeline's stages) saved `directory`."""
    return len({mp for _, mp, _ in _ranked(directory, _MODEL)}) or 1


def pipeline_layer_files(directory: Path) -> dict[int, list[Path]]:
    """A pipeline checkpoint's layer files by layer index (several with tensor parallelism)."""
    layers: dict[int, list[Path]] = {}
    for path in sorted(directory.iterdir()):
        match = _LAYER.fullmatch(path.name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(path)
    return layers


def _holds_deepspeed_files(directory: Path) -> bool:
    if not directory.is_dir():
        return False
    names = [p.name for p in directory.iterdir()]
    return (
        any(_MODEL.fullmatch(n) or _LAYER.fullmatch(n) for n in names)
        or (directory / "zero" / "optimizer_state.pt").is_file()
    )


def resolve_deepspeed(root: Path, tag: str | None, *, universal: bool = False) -> Path | None:
    """The folder of a DeepSpeed checkpoint at `root`: itself, its tag `tag`, or the tag its
    ``latest`` names (``latest_universal`` with `universal`, DeepSpeed's
    ``checkpoint.load_universal``, or when there is no ``latest``); None when that is no
    DeepSpeed folder (zstack's own, or none)."""
    if tag is not None:
        return root / tag if _holds_deepspeed_files(root / tag) else None
    if _holds_deepspeed_files(root):
        return root
    # `latest` wins unless asked for the universal one: beside zstack's checkpoint whose
    # `latest` it is, a universal export (save_checkpoint(universal=True)) is not what resumes
    pointer = LATEST_UNIVERSAL if universal or not (root / LATEST).exists() else LATEST
    try:
        named = (root / pointer).read_text().strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    return root / named if named and _holds_deepspeed_files(root / named) else None


def is_deepspeed(directory: Path) -> bool:
    """Whether `directory` is one tag of a DeepSpeed checkpoint (or a universal one)."""
    return _holds_deepspeed_files(directory)
