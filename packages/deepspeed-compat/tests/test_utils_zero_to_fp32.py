"""``deepspeed.utils.zero_to_fp32``'s file listings and how the module loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import deepspeed.utils
from deepspeed.utils.zero_to_fp32 import get_model_state_files, get_optim_files


def test_rank_files_in_rank_order(tmp_path: Path) -> None:
    """Rank 10 after rank 9 (a plain sort puts it after rank 1), as DeepSpeed lists them."""
    for rank in (10, 2, 0, 1, 9):
        (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
        (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").touch()
    ranks = [0, 1, 2, 9, 10]
    assert get_optim_files(tmp_path) == [
        str(tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in ranks
    ]
    assert get_model_state_files(tmp_path) == [
        str(tmp_path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in ranks
    ]


def test_no_files_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"can't find \*_optim_states\.pt files"):
        get_optim_files(tmp_path)


def test_the_module_loads_on_first_use_and_runs_once() -> None:
    """``deepspeed.utils.zero_to_fp32`` is there by attribute, as DeepSpeed's, but not loaded
    by ``import deepspeed.utils``: ``python -m`` then runs it without runpy's warning that it
    was imported already."""
    assert deepspeed.utils.zero_to_fp32.get_optim_files is get_optim_files
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "deepspeed.utils.zero_to_fp32", "-h"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "checkpoint_dir" in done.stdout
    assert "RuntimeWarning" not in done.stderr
