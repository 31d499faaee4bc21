"""Checkpoints: the engine's state saved and loaded, and the files written and read.

Owns ``save_checkpoint`` / ``load_checkpoint`` (_save_load.py) over torch.distributed.checkpoint
(_dcp.py, _pieces.py), what is saved of an engine (_state.py), the manifest saying what a
checkpoint is of (_manifest.py), the directory, ``latest`` and the CRCs (_files.py), the ranks'
agreement (_sync.py), a pipeline's checkpoint in stages (_stages.py, _stage_layout.py,
_stage_reshape.py), ``zengine consolidate`` and zero_to_fp32's reading (_consolidate.py), the
16-bit model save (_save_16bit.py), the ``zero_to_fp32.py`` written into a save_dir
(_recovery.py), and Hugging Face safetensors: the format (_safetensors.py),
a checkpoint's files (_safetensors_checkpoint.py) and a load into a ZeRO-3 model
(_safetensors_load.py); DeepSpeed's checkpoints read into an engine or consolidated: its files
(_ds_files.py), where each parameter lies in them (_ds_layout.py), their reading by
parameter name (_ds_checkpoint.py), a pipeline's stages merged
(_ds_pipeline.py), the load (_ds_load.py); DeepSpeed's universal checkpoint written from ours
(_universal_write.py, _universal_layout.py); torch files read without running code
(_safe_load.py) and DCP's (_dcp_read.py), and what a client state may hold
(_client_state.py). Its errors are in _errors.py. A save's and a load's options are one object
each (_options.py), made by the engine from its public arguments. It reads the engine through
the attributes its Protocols declare (_engine_view.py) and never imports it, nor the
optimizer or the pipeline, even for a type.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zengine._checkpoint._ds_files import expert_optim_name
from zengine._checkpoint._engine_view import StageEngine
from zengine._checkpoint._errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointTagError,
    ClientStateError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from zengine._checkpoint._files import resolve
from zengine._checkpoint._options import LoadOptions, SaveOptions
from zengine._checkpoint._recovery import change_permissions
from zengine._checkpoint._safetensors import SafetensorsWriter, read_safetensors
from zengine._checkpoint._safetensors_load import load_safetensors_into
from zengine._checkpoint._sync import Sync

if TYPE_CHECKING:
    from zengine._checkpoint._consolidate import (
        DEFAULT_BUDGET,
        Entry,
        consolidate,
        consolidate_shards,
        contents_of,
        fp32_state_dict,
        open_model,
        read_tensors,
    )
    from zengine._checkpoint._save_16bit import gathered_state, save_16bit_model
    from zengine._checkpoint._save_load import load_checkpoint, save_checkpoint
    from zengine._checkpoint._stage_layout import PipelineLayers, StageLayout
    from zengine._checkpoint._stages import load_stages, save_stages
    from zengine._checkpoint._universal_write import export_universal

__all__ = [
    "DEFAULT_BUDGET",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointTagError",
    "ClientStateError",
    "CorruptCheckpointError",
    "Entry",
    "LoadOptions",
    "PipelineLayers",
    "SafetensorsWriter",
    "SaveOptions",
    "StageEngine",
    "StageLayout",
    "Sync",
    "UnsafeCheckpointError",
    "change_permissions",
    "consolidate",
    "consolidate_shards",
    "contents_of",
    "expert_optim_name",
    "export_universal",
    "fp32_state_dict",
    "gathered_state",
    "load_checkpoint",
    "load_safetensors_into",
    "load_stages",
    "open_model",
    "read_safetensors",
    "read_tensors",
    "resolve",
    "save_16bit_model",
    "save_checkpoint",
    "save_stages",
]

# torch.distributed.checkpoint takes about a second and 50 MiB to import: the modules that import
# it are imported when one of their names is first asked for (PEP 562), not by ``import zengine``.
_LAZY = {
    "_consolidate": (
        "DEFAULT_BUDGET",
        "Entry",
        "consolidate",
        "consolidate_shards",
        "contents_of",
        "fp32_state_dict",
        "open_model",
        "read_tensors",
    ),
    "_save_16bit": ("gathered_state", "save_16bit_model"),
    "_save_load": ("load_checkpoint", "save_checkpoint"),
    "_stage_layout": ("PipelineLayers", "StageLayout"),
    "_stages": ("load_stages", "save_stages"),
    "_universal_write": ("export_universal",),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

if not TYPE_CHECKING:  # mypy reads the imports above; an unknown name stays an error for it

    def __getattr__(name: str) -> Any:
        module = _MODULE_OF.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value
