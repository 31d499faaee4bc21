"""What Accelerate, Transformers and TRL write into a DeepSpeed config besides DeepSpeed's keys:
dotted top-level keys, and "auto" values.

[Note: dotted keys and "auto"]
Accelerate and Transformers name a config's nested keys by dotted paths
(``HfDeepSpeedConfig.get_value("zero_optimization.reduce_bucket_size")``) and fill them in place.
TRL's ``prepare_deepspeed`` (1.16) instead adds them with ``dict.update``, so the config it gives
``deepspeed.initialize`` for a reference, reward or teacher model holds top-level keys such as
``"zero_optimization.reduce_bucket_size"`` beside the nested ``"auto"`` values it meant to fill.

DeepSpeed 0.19.8 reads the top level of its config with ``dict.get`` and never looks at a key it
does not know, so there those keys do nothing (nor does a misspelt top-level key), and its
pydantic sections drop every ``"auto"`` value, leaving the section's default. zstack refuses
unknown keys rather than ignoring them, so the choice was between refusing TRL's keys and
reading them as their writers mean them; they are read as Accelerate reads a dotted path: the
nested key, whose value the dotted key replaces. A dotted key is validated as the nested key
would be: a misspelt one is an unknown key with its closest valid key, as any other. The one
leniency: a count written by a dotted key as a fractional float is rounded down, as Accelerate
and Transformers round the same value (``int(0.9 * hidden_size**2)``) where TRL does not.

``"auto"`` means "the training run fills this in" (Transformers' Trainer and Accelerate do, from
the model and the training arguments, before the training engine is made). A model without an
optimizer (an inference or a reference engine) is made from the config as it stands, possibly
before the training run has filled it: there each ``"auto"`` is dropped and the key takes the
engine's default, as DeepSpeed does; batch sizes that are all ``"auto"`` are one sample per
rank, which only counts the samples of a forward pass. In a training config an ``"auto"`` left
unfilled is still an error: the run would train with values no one chose.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, BeforeValidator

from zengine._config._errors import _keys, _model_at, show
from zengine._config._sections import _whole_number

__all__ = ["AUTO", "expand_dotted", "without_auto"]

AUTO = "auto"
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def expand_dotted(
    data: Mapping[Any, Any], root: type[BaseModel]
) -> tuple[dict[Any, Any], list[str]]:
    """`data` (a copy; the sections a dotted key reaches are copied too) with each top-level key
    ``"a.b.c"`` moved to ``data["a"]["b"]["c"]``, replacing the value there ([Note: dotted keys
    and "auto"]), and the problems: a dotted key that reaches into a value that is not a section.
    `root` is the config's model, which says which nested keys are counts."""
    out = {k: v for k, v in data.items() if not _is_dotted(k)}
    problems: list[str] = []
    for key, value in data.items():
        if not _is_dotted(key):
            continue
        *sections, leaf = key.split(".")
        node = out
        for depth, name in enumerate(sections):
            inner = node.get(name)
            if inner is None:
                inner = {}
            elif not isinstance(inner, Mapping):
                where = ".".join(sections[: depth + 1])
                problems.append(
                    f"{key}: a dotted key for a nested one, but {where} is not a section "
                    f"(got {show(inner)})"
                )
                break
            node[name] = dict(inner)
            node = node[name]
        else:
            node[leaf] = _rounded_count(value, root, [*sections, leaf])
    return out, problems


def without_auto(data: Mapping[Any, Any]) -> dict[Any, Any]:
    """`data` without its ``"auto"`` values, at any depth (a copy), for a model without an
    optimizer ([Note: dotted keys and "auto"]); batch sizes that were all ``"auto"`` (and none
    given) become one sample per rank."""
    out = _drop_auto(data)
    if any(data.get(k) == AUTO for k in _BATCH_KEYS) and not any(k in out for k in _BATCH_KEYS):
        out["train_micro_batch_size_per_gpu"] = 1
    return out


def _drop_auto(section: Mapping[Any, Any]) -> dict[Any, Any]:
    return {
        k: _drop_auto(v) if isinstance(v, Mapping) else v
        for k, v in section.items()
        if not (isinstance(v, str) and v == AUTO)
    }


def _is_dotted(key: object) -> bool:
    return isinstance(key, str) and "." in key.strip(".")


def _rounded_count(value: object, root: type[BaseModel], path: list[str]) -> object:
    """A fractional float for a count (a `Size` key) rounded down; anything else as it is."""
    if not isinstance(value, float) or not math.isfinite(value) or value.is_integer():
        return value
    model = _model_at(root, list(path[:-1]))
    name = None if model is None else _keys(model).get(path[-1])
    if model is None or name is None:
        return value
    field = model.model_fields[name]
    counts = any(isinstance(m, BeforeValidator) and m.func is _whole_number for m in field.metadata)
    return math.floor(value) if counts and value >= 0 else value
