"""``deepspeed.checkpoint``'s names of DeepSpeed's checkpoint files and keys, and
``deepspeed.runtime.checkpoint_engine``: torch.save and weights-only torch.load behind
DeepSpeed's interface."""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import deepspeed.checkpoint
from deepspeed.checkpoint import (
    UNIVERSAL_CHECKPOINT_INFO,
    get_layer_ckpt_name_for_rank,
    get_model_ckpt_name_for_rank,
    get_zero_ckpt_name_for_rank,
)
from deepspeed.checkpoint import constants as names
from deepspeed.runtime.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
    TorchCheckpointEngine,
)


def test_the_file_names_of_a_deepspeed_checkpoint() -> None:
    tag = os.path.join("ckpt", "global_step3")
    assert get_model_ckpt_name_for_rank(tag, "00") == os.path.join(
        tag, "mp_rank_00_model_states.pt"
    )
    assert get_zero_ckpt_name_for_rank(tag, 5, 0) == os.path.join(
        tag, "zero_pp_rank_5_mp_rank_00_optim_states.pt"
    )
    assert get_layer_ckpt_name_for_rank(tag, "layer_01", 2) == os.path.join(
        tag, "layer_01-model_02_model_states.pt"
    )
    assert names.BF16_ZERO_FILE_PREFIX == "bf16_zero_pp_rank_"


def test_the_constants_are_deepspeeds_key_strings_also_at_the_top() -> None:
    assert UNIVERSAL_CHECKPOINT_INFO == "universal_checkpoint_info"
    assert (names.OPTIMIZER_STATE_DICT, names.PARAM_SHAPES, names.FP32_WEIGHT_KEY) == (
        "optimizer_state_dict",
        "param_shapes",
        "fp32",
    )
    assert names.UNIVERSAL_CHECKPOINT_VERSION_VALUE == 0.4
    for name in names.__all__:  # DeepSpeed's ``from .constants import *``
        assert getattr(deepspeed.checkpoint, name) == getattr(names, name)


def test_the_torch_engine_round_trips_a_state_dict(tmp_path: Path) -> None:
    engine = TorchCheckpointEngine()
    assert isinstance(engine, CheckpointEngine)
    assert engine.name == "TorchCheckpointEngine"
    info = CheckpointCommitInfo(tag="global_step1", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    engine.makedirs(tmp_path / "global_step1", exist_ok=True)
    state: dict[str, Any] = {"module": {"w": torch.arange(4.0)}, "step": 3, "names": ["a", "b"]}
    path = str(tmp_path / "global_step1" / "mp_rank_00_model_states.pt")
    engine.save(state, path)
    assert engine.commit(info)
    loaded = engine.load(path, map_location="cpu")
    assert torch.equal(loaded["module"]["w"], state["module"]["w"])
    assert (loaded["step"], loaded["names"]) == (3, ["a", "b"])
    assert engine.is_data_parallel_writer(0)
    assert not engine.is_data_parallel_writer(1)
    assert not engine.is_decoupled()
    assert engine.get_commit_info() is None


def test_a_load_runs_no_pickled_code(tmp_path: Path) -> None:
    """DeepSpeed's engine loads with weights_only=False; this one refuses what is not
    tensors, containers and plain values."""
    engine = TorchCheckpointEngine()
    path = str(tmp_path / "args.pt")
    engine.save({"args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        engine.load(path)
