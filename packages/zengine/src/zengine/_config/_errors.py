"""`ConfigError`, and pydantic's validation errors rewritten as one line per problem.

Each line starts with the key's full dotted path (``zero_optimization.stage``), then says what
is wrong and what was given; an unknown key gets the closest valid key at its level.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import AliasChoices, BaseModel, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

__all__ = ["ConfigError", "config_error", "describe_validation_error", "dotted", "show"]

_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "float_type": "a number",
    "float_parsing": "a number",
    "string_type": "a string",
    "dict_type": "an object of keys and values",
    "model_type": "an object of keys and values",
    "model_attributes_type": "an object of keys and values",
    "path_type": "a path (a string)",
}

_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


class ConfigError(ValueError):
    """A config is invalid: every problem found, one per line, each naming the key's full path.

    ``problems`` holds the lines. Raised by `load_config`; a ``ValueError``, as DeepSpeed's
    config errors are.
    """

    def __init__(self, problems: Iterable[str] | str) -> None:
        # A str is the joined message: unpickling passes it back (ranks send errors home).
        lines = problems.splitlines() if isinstance(problems, str) else list(problems)
        self.problems: tuple[str, ...] = tuple(lines)
        super().__init__("\n".join(self.problems))


def config_error(message: str, *, key: str | None = None) -> PydanticCustomError:
    """A validation error whose message is ``message`` as written.

    ``key`` names a sub-key of the model being validated, so that a rule checked on a whole
    section (``nvme_path`` is needed when ``device`` is ``nvme``) points at the key to fix.
    """
    context: dict[str, Any] = {"message": message}
    if key is not None:
        context["key"] = key
    return PydanticCustomError("zstack_config", "{message}", context)


def show(value: object) -> str:
    """``repr(value)``, cut short so that one problem stays on one line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_validation_error(
    error: ValidationError,
    root: type[BaseModel],
    more_keys: Callable[[tuple[str, ...]], Iterable[str]] = lambda path: (),
) -> list[str]:
    """One line per error in ``error``, raised while validating a ``root`` model. An unknown
    key's closest match is looked for among the model's keys at its level and ``more_keys``
    of that level's path (keys taken out before validation)."""
    return [_describe(details, root, more_keys) for details in error.errors(include_url=False)]


def dotted(loc: Iterable[int | str]) -> str:
    """``("zero_optimization", "stage")`` -> ``zero_optimization.stage``; indices as ``[i]``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path or "config"


def _describe(
    details: ErrorDetails,
    root: type[BaseModel],
    more_keys: Callable[[tuple[str, ...]], Iterable[str]],
) -> str:
    loc = list(details["loc"])
    context = details.get("ctx", {})
    if details["type"] == "zstack_config":
        if "key" in context:
            loc.append(context["key"])
        return f"{dotted(loc)}: {context['message']}"
    if details["type"] == "extra_forbidden":
        return f"{dotted(loc)}: {_unknown_key(root, loc, more_keys)}"
    return f"{dotted(loc)}: {_what(details)}"


def _what(details: ErrorDetails) -> str:
    kind, given = details["type"], show(details["input"])
    context = details.get("ctx", {})
    if kind == "missing":
        return "required, but not given"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {given}"
    if kind == "literal_error":
        return f"expected {context['expected']}, got {given}"
    if kind in _BOUNDS:
        sign, name = _BOUNDS[kind]
        return f"must be {sign} {_number(context[name])}, got {given}"
    if kind == "finite_number":
        return f"must be a finite number, got {given}"
    return f"{details['msg']}, got {given}"


def _number(bound: object) -> object:
    # A float field's bound comes back as 0.0; the config's reader wrote 0.
    return int(bound) if isinstance(bound, float) and bound.is_integer() else bound


def _unknown_key(
    root: type[BaseModel],
    loc: list[int | str],
    more_keys: Callable[[tuple[str, ...]], Iterable[str]],
) -> str:
    key, model = str(loc[-1]), _model_at(root, loc[:-1])
    if model is None:
        return "unknown key"
    names = _keys(model)
    if key in names:  # the other name of a key that was also given under its main name
        return f"the same key as {names[key]!r} (another of its names); give only one"
    level = tuple(str(part) for part in loc[:-1])
    close = difflib.get_close_matches(key, [*names, *more_keys(level)], n=1)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return f"unknown key (valid keys: {', '.join(sorted(names))})"


def _keys(model: type[BaseModel]) -> dict[str, str]:
    """Every key ``model`` accepts, mapped to the main name of its field."""
    keys: dict[str, str] = {}
    for name, field in model.model_fields.items():
        keys[name] = name
        if isinstance(field.validation_alias, AliasChoices):
            keys.update({str(c): name for c in field.validation_alias.choices if c != name})
    return keys


def _model_at(root: type[BaseModel], loc: list[int | str]) -> type[BaseModel] | None:
    """The section model found by following the keys ``loc`` down from ``root``."""
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None or not isinstance(part, str):
            return None
        name = _keys(model).get(part)
        model = None if name is None else _model_in(model.model_fields[name].annotation)
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class in ``annotation``: itself, or the model of ``Model | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
