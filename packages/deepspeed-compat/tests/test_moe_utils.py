"""``deepspeed.moe.utils``: DeepSpeed's split of parameter groups into dense and expert groups
leaves a model without expert-parallel parameters as it is, and refuses one with them."""

from __future__ import annotations

import pytest
import torch

import deepspeed
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer


def test_dense_groups_pass_through_as_lists() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    group = {"params": model.parameters(), "name": "parameters", "lr": 0.1}
    (split,) = split_params_into_different_moe_groups_for_optimizer(group)
    assert split == {"params": list(model.parameters()), "name": "parameters", "lr": 0.1}
    two = [{"params": [p], "name": str(i)} for i, p in enumerate(model.parameters())]
    assert split_params_into_different_moe_groups_for_optimizer(tuple(two)) == two
    with pytest.raises(ValueError, match="expected a parameter group"):
        split_params_into_different_moe_groups_for_optimizer("params")  # type: ignore[arg-type]


def test_an_expert_parallel_parameter_is_refused() -> None:
    expert = torch.nn.Parameter(torch.ones(2))
    assert not is_moe_param(expert)
    expert.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's mark
    expert.group_name = "ep_size_2"  # type: ignore[attr-defined]
    assert is_moe_param(expert)
    with pytest.raises(deepspeed.UnsupportedFeatureError, match="expert parallelism"):
        split_params_into_different_moe_groups_for_optimizer({"params": [expert], "name": "x"})
