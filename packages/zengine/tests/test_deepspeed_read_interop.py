"""zstack reads what the installed DeepSpeed writes, checked against DeepSpeed itself (marked
``deepspeed``: ``nox -s interop`` runs them beside DeepSpeed 0.19.8 from PyPI).

The fixtures in deepspeed_checkpoints/ were written once; here DeepSpeed writes afresh, so a
DeepSpeed release that changes its files is caught: its own ``zero_to_fp32`` and zstack's
consolidation give the same tensors, and a run DeepSpeed saves continues on zstack with
DeepSpeed's losses.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import zcomm
from zcomm.testing import DistributedTest
from zengine._checkpoint import fp32_state_dict

from . import _ds_fixture as fx
from ._deepspeed_groups import forget_deepspeed_groups
from .test_checkpoint_deepspeed import BEFORE, engine, largest_gap, train

deepspeed = pytest.importorskip("deepspeed")
pytestmark = pytest.mark.deepspeed


def deepspeed_engine(config: dict[str, Any]) -> Any:
    m = fx.model()
    eng, *_ = deepspeed.initialize(model=m, model_parameters=fx.param_groups(m), config=config)
    return eng


def deepspeed_train(eng: Any, data: list[torch.Tensor]) -> list[float]:
    rank, world = zcomm.get_rank(), zcomm.get_world_size()
    out = []
    for tokens in data:
        loss = eng(fx.local(tokens, rank, world))
        eng.backward(loss)
        eng.step()
        mean = loss.detach().float().reshape(1).clone()
        zcomm.all_reduce(mean)
        out.append(mean.item() / world)
    return out


@pytest.mark.parametrize(
    "case", sorted(c for c in fx.CASES if not c.startswith("stage0"))
)  # DeepSpeed's zero_to_fp32 reads no stage-0 checkpoint
def test_consolidation_equals_deepspeeds_zero_to_fp32(case: str) -> None:
    from deepspeed.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint as deepspeeds,
    )

    theirs = deepspeeds(str(fx.FIXTURES / case))
    ours = fp32_state_dict(fx.FIXTURES / case)
    # ZeRO-1 records no frozen parameters, which DeepSpeed's tool then drops; zstack keeps them
    assert set(theirs) <= set(ours)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor.contiguous().float()), name


class TestWrittenNow(DistributedTest):
    """DeepSpeed trains and saves in these ranks; zstack loads and continues."""

    world_size = 2

    def test_continues_with_deepspeeds_losses(self, tmp_path: Path) -> None:
        forget_deepspeed_groups()
        for case in ("stage3_fp32_ws2", "stage2_fp16_ws2", "stage1_bf16_ws2"):
            data = fx.batches(2 * BEFORE)
            config = fx.config(case)
            theirs = deepspeed_engine(config)
            deepspeed_train(theirs, data[:BEFORE])
            theirs.save_checkpoint(str(tmp_path / case), client_state={"epoch": 1})
            after = deepspeed_train(theirs, data[BEFORE:])
            theirs.destroy()
            own = largest_gap(train(engine(config), data)[BEFORE:], after)
            loaded = engine(config)
            _, client = loaded.load_checkpoint(tmp_path / case)
            assert client is not None
            assert client["epoch"] == 1
            gap = largest_gap(train(loaded, data[BEFORE:]), after)
            assert math.isfinite(gap)
            assert gap <= 2 * own + 1e-5, f"{case}: {gap} from DeepSpeed's losses (apart: {own})"
