"""A save's and a load's options, made once from ``engine.save_checkpoint`` /
``engine.load_checkpoint``'s arguments and handed down whole.

The engine's public methods keep DeepSpeed's signatures; below them every layer (the engine's
and the pipeline engine's ``_write_checkpoint`` / ``_read_checkpoint``, pipe/_checkpoint.py,
_stages.py, _save_load.py, _ds_load.py) takes one of these instead of repeating the arguments.
A caller that saves or loads otherwise (a pipeline's stage: no ``zero_to_fp32.py`` of its own,
files checked once for all stages) changes a field with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

__all__ = ["LoadOptions", "SaveOptions"]


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """``engine.save_checkpoint(save_dir, tag, client_state, save_latest,
    exclude_frozen_parameters, universal=...)``, and `recovery_script`: whether rank 0 writes
    ``zero_to_fp32.py`` into `save_dir` (a pipeline's stage does not: its save_dir is not the
    one users run it in)."""

    save_dir: str | os.PathLike[str]
    tag: str | None = None
    client_state: dict[str, Any] | None = None  # this rank's own
    save_latest: bool = True
    exclude_frozen_parameters: bool = False
    universal: bool = False  # also DeepSpeed's universal checkpoint, beside it
    recovery_script: bool = True


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """``engine.load_checkpoint(load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
    load_module_strict=..., load_module_only=...)``, and `verify`: False where the caller has
    checked the files' CRCs already (a pipeline's stages, all before any reads)."""

    load_dir: str | os.PathLike[str]
    tag: str | None = None
    load_optimizer_states: bool = True
    load_lr_scheduler_states: bool = True
    load_module_strict: bool = True
    load_module_only: bool = False
    verify: bool = True
