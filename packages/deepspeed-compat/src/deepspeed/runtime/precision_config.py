"""``deepspeed.runtime.precision_config``: DeepSpeed's ``fp16`` and ``bf16`` section models, which
are zengine's (`zengine.config`), and its readers of them out of a whole config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import zengine.config
from zengine.config import BF16Config as DeepSpeedBF16Config
from zengine.config import FP16Config as DeepSpeedFP16Config

__all__ = [
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "get_bfloat16_config",
    "get_float16_config",
]

_S = TypeVar("_S", DeepSpeedBF16Config, DeepSpeedFP16Config)


def _section(param_dict: Mapping[str, Any], key: str, model: type[_S]) -> _S:
    section = zengine.config.read_section(param_dict, key)
    if not isinstance(section, model):  # read_section's model for `key`: never
        raise TypeError(f"{key}: read as {type(section).__name__}, not {model.__name__}")
    return section


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> DeepSpeedBF16Config:
    """The config's ``bf16`` section (or its older name ``bfloat16``), validated, with
    DeepSpeed's defaults when it has none."""
    return _section(param_dict, "bf16", DeepSpeedBF16Config)


def get_float16_config(param_dict: Mapping[str, Any]) -> DeepSpeedFP16Config:
    """The config's ``fp16`` section, validated, with DeepSpeed's defaults when it has none."""
    return _section(param_dict, "fp16", DeepSpeedFP16Config)
