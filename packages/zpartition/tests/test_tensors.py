"""is_zero_param and apply_to_tensors_only over nested inputs and outputs."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from zpartition import _tensors
from zpartition._tensors import apply_to_tensors_only, is_zero_param


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    # Warnings are once per type and process; each test starts as a fresh process would.
    monkeypatch.setattr(_tensors, "_warned_types", set())


def zero_param(ds_id: int = 0) -> nn.Parameter:
    p = nn.Parameter(torch.arange(3.0))
    p.ds_id = ds_id
    return p


def double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


class Pair(NamedTuple):
    first: torch.Tensor
    second: object


@dataclass
class Output:
    loss: torch.Tensor


# --- is_zero_param ------------------------------------------------------------------------


def test_is_zero_param() -> None:
    assert is_zero_param(zero_param())
    assert not is_zero_param(nn.Parameter(torch.ones(1)))
    assert not is_zero_param(torch.ones(1))
    plain = torch.ones(1)
    plain.ds_id = 4
    assert is_zero_param(plain)  # any tensor carrying ds_id


def test_non_tensors_are_not_zero_params() -> None:
    class Fake:
        ds_id = 1

    assert not is_zero_param(Fake())
    assert not is_zero_param(None)


# --- apply_to_tensors_only ----------------------------------------------------------------


def test_single_tensor() -> None:
    assert torch.equal(apply_to_tensors_only(double, torch.ones(2)), torch.full((2,), 2.0))


def test_nested_containers_are_rebuilt_with_their_types() -> None:
    t = torch.ones(2)
    value: tuple[Any, ...] = (t, [t, {"a": t, "n": 3}], Pair(t, "s"), None, 1.5)
    out = apply_to_tensors_only(double, value)
    assert type(out) is tuple
    assert type(out[1]) is list
    assert type(out[2]) is Pair
    assert out[2].second == "s"
    assert out[3:] == (None, 1.5)
    for tensor in (out[0], out[1][0], out[1][1]["a"], out[2].first):
        assert torch.equal(tensor, t * 2)
    assert out[1][1]["n"] == 3
    assert torch.equal(t, torch.ones(2))  # the function's result, not an in-place change


def test_tuple_and_list_subclasses_keep_their_type() -> None:
    class Batch(list[torch.Tensor]):
        pass

    out = apply_to_tensors_only(double, Batch([torch.ones(1)]))
    assert type(out) is Batch
    assert torch.equal(out[0], torch.full((1,), 2.0))
    size = apply_to_tensors_only(double, torch.Size([2, 3]))
    assert type(size) is torch.Size
    assert size == torch.Size([2, 3])


def test_dicts_are_updated_in_place() -> None:
    # dict subclasses (transformers' ModelOutput) may not be rebuildable from items
    value: OrderedDict[str, Any] = OrderedDict(b=torch.ones(1), a=[torch.ones(1)])
    out = apply_to_tensors_only(double, value)
    assert out is value
    assert list(out) == ["b", "a"]
    assert torch.equal(out["b"], torch.full((1,), 2.0))


def test_zero_param_gets_an_alias_when_replaced() -> None:
    p = zero_param(ds_id=7)
    out = apply_to_tensors_only(double, (p,))
    assert not is_zero_param(out[0])
    assert out[0].ds_param_alias is p


def test_no_alias_when_the_param_comes_back_or_for_plain_tensors() -> None:
    p = zero_param()
    assert apply_to_tensors_only(lambda t: t, p) is p
    assert not hasattr(p, "ds_param_alias")
    other = zero_param(ds_id=1)
    assert apply_to_tensors_only(lambda t: other, p) is other
    assert not hasattr(other, "ds_param_alias")
    assert not hasattr(apply_to_tensors_only(double, torch.ones(1)), "ds_param_alias")


def test_function_is_applied_once_per_occurrence() -> None:
    seen: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    a, b = torch.ones(1), torch.zeros(1)
    apply_to_tensors_only(record, {"x": (a, [b]), "y": a})
    assert [id(t) for t in seen] == [id(a), id(b), id(a)]


def test_other_objects_pass_through_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="zpartition")
    obj = Output(loss=torch.ones(1))
    message = lambda value: f"unknown type {type(value).__name__}"  # noqa: E731
    assert apply_to_tensors_only(double, obj, message) is obj
    assert torch.equal(obj.loss, torch.ones(1))  # not reached into
    apply_to_tensors_only(double, [obj, Output(loss=torch.ones(1))], message)
    assert [r.getMessage() for r in caplog.records] == ["unknown type Output"]


def test_warning_names_each_new_type(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="zpartition")
    message = lambda value: f"unknown type {type(value).__name__}"  # noqa: E731

    class Opaque:
        pass

    apply_to_tensors_only(double, (Output(torch.ones(1)), {"o": Opaque()}), message)
    assert [r.getMessage() for r in caplog.records] == [
        "unknown type Output",
        "unknown type Opaque",
    ]


def test_no_warning_for_builtins_or_without_a_message(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="zpartition")
    apply_to_tensors_only(double, (1, "s", None, 2.0, b"x", {1, 2}), lambda v: "builtin")
    apply_to_tensors_only(double, Output(torch.ones(1)))
    assert caplog.records == []
