"""The compatibility package's tests import two kinds of helpers by top-level name: DeepSpeed's
test helpers that its own tests import unchanged (``unit.common``, ``unit.simple_model``,
``utils``), and this folder's (``_helpers``, which the torchrun scripts import too).

DeepSpeed's ``test_offload_states.py`` (a seed, kept unchanged) measures accelerator memory on
two ranks: it runs where two CUDA devices are visible and is skipped elsewhere.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name == "test_seed_offload_states.py":
            item.add_marker(pytest.mark.gpu)
            if torch.cuda.device_count() < 2:
                item.add_marker(pytest.mark.skip(reason="needs two CUDA devices (world size 2)"))
