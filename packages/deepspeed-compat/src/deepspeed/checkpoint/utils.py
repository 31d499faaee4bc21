"""``deepspeed.checkpoint.utils``: the paths of DeepSpeed's checkpoint files within a tag's
folder, and `clone_tensors_for_torch_save`."""

from __future__ import annotations

import os
from typing import TypeVar

import torch
from torch.utils._pytree import tree_map

from deepspeed.checkpoint.constants import (
    MODEL_FILE_PREFIX,
    MODEL_FILE_SUFFIX,
    OPTIM_FILE_SUFFIX,
    ZERO_FILE_PREFIX,
)

__all__ = [
    "clone_tensors_for_torch_save",
    "get_layer_ckpt_name_for_rank",
    "get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank",
]

_T = TypeVar("_T")


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """``base_folder/mp_rank_<mp_rank_str>_model_states.pt``: the model-states file of one
    model-parallel rank (its number as a string, DeepSpeed's ``"00"``)."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """``base_folder/zero_pp_rank_<dp>_mp_rank_<mp:02d>_optim_states.pt``: one data-parallel
    rank's optimizer partition."""
    name = f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}"
    return os.path.join(base_folder, name)


def get_layer_ckpt_name_for_rank(base_folder: str, layer_id: str, tp_rank: int) -> str:
    """``base_folder/<layer_id>-model_<tp:02d>_model_states.pt``: one pipeline layer's file
    (`layer_id` as DeepSpeed writes it, ``"layer_01"``)."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item: _T, device: torch.device | str = "cpu") -> _T:
    """`item` with every nested tensor cloned onto `device`, so ``torch.save`` writes each
    tensor's own elements rather than the whole storage a view shares (DeepSpeed's)."""

    def clone(value: object) -> object:
        return value.detach().clone().to(device) if isinstance(value, torch.Tensor) else value

    cloned: _T = tree_map(clone, item)
    return cloned
