"""``deepspeed.moe.utils``: DeepSpeed's split of the optimizer's parameter groups into dense and
expert groups. With no expert-parallel parameter (the only kind zstack trains, see `layer`) the
split leaves the groups as they are, which is what DeepSpeed's test helpers and scripts pass
every model through; an expert-parallel parameter is refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from deepspeed._refused import EXPERT_PARALLEL, refused

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]

_expert_groups = refused(
    "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer", *EXPERT_PARALLEL
)


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether `param` carries DeepSpeed's mark of an expert-parallel parameter (its experts'
    weights are reduced within their expert group, ``allreduce`` False)."""
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: Mapping[str, Any] | list[Mapping[str, Any]] | tuple[Mapping[str, Any], ...],
    max_group_size: int | float | None = 178956971,
) -> list[dict[str, Any]]:
    """The groups (one dict, or a list or tuple of them) as a list, each group's ``params`` a
    list: DeepSpeed's split when no parameter is an expert-parallel one.

    Raises:
        UnsupportedFeatureError: a parameter marked as an expert-parallel one.
        ValueError: `param_groups` of another type.
    """
    del max_group_size  # the size of DeepSpeed's expert groups, of which there are none here
    if isinstance(param_groups, Mapping):
        param_groups = [param_groups]
    if not isinstance(param_groups, (list, tuple)):
        raise ValueError(
            "split_params_into_different_moe_groups_for_optimizer: expected a parameter group "
            f"(a dict) or a list of them, got {type(param_groups).__name__}"
        )
    groups = [{**group, "params": list(group["params"])} for group in param_groups]
    if any(is_moe_param(p) for group in groups for p in group["params"]):
        _expert_groups()
    return groups
