"""ZeRO-3 leaf marks: by class, name and suffix, and chosen by granularity."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from zpartition._leaf import (
    get_z3_leaf_modules,
    leaf_modules_by_granularity,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

D, VOCAB = 8, 16


class Block(nn.Module):
    """fc (72 elements) + norm (16) + a parameter-free GELU: 88 elements, 3 layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.act = nn.GELU()


class SubBlock(Block):
    pass


class Model(nn.Module):
    """embed (128) + 2 blocks (176) + head (144) = 448 elements in 9 layers."""

    def __init__(self, block: type[Block] = Block) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([block() for _ in range(2)])
        self.drop = nn.Dropout()
        self.head = nn.Linear(D, VOCAB)


# Granularities of Model, by hand: Block 88 // 3 = 29; root 448 // (1 + 6 + 1 + 1) = 49.
BLOCK_G, ROOT_G = 29, 49


@pytest.fixture
def model() -> Model:
    return Model()


def ids(modules: Sequence[object]) -> list[int]:
    return [id(m) for m in modules]


def marked(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if z3_leaf_module(m)}


# --- one module ---------------------------------------------------------------------------


def test_set_one_module_marks_only_it(model: Model) -> None:
    set_z3_leaf_module(model.blocks[0], True)
    assert z3_leaf_module(model.blocks[0])
    assert marked(model) == {"blocks.0"}
    set_z3_leaf_module(model.blocks[0], False)
    assert not z3_leaf_module(model.blocks[0])
    assert marked(model) == set()


def test_mark_is_a_plain_attribute(model: Model) -> None:
    before = (list(model.state_dict()), [n for n, _ in model.named_modules()])
    set_z3_leaf_module(model, True)
    assert vars(model)["_z3_leaf"] is True
    leaf: object = model._z3_leaf  # DeepSpeed's attribute, readable by other libraries
    assert leaf is True
    assert (list(model.state_dict()), [n for n, _ in model.named_modules()]) == before


def test_mark_set_by_plain_assignment_is_seen(model: Model) -> None:
    model.head._z3_leaf = True  # type: ignore[assignment]  # as code written for DeepSpeed may
    assert z3_leaf_module(model.head)
    assert ids(get_z3_leaf_modules(model)) == ids([model.head])


def test_delegating_wrapper_does_not_report_the_wrapped_mark() -> None:
    class Delegating(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

    inner = nn.Linear(2, 2)
    wrapper = Delegating(inner)
    set_z3_leaf_module(inner, True)
    leaked: object = wrapper._z3_leaf
    assert leaked is True  # the delegation would leak it...
    assert not z3_leaf_module(wrapper)  # ...but the mark is read from the module's own dict
    assert ids(get_z3_leaf_modules(wrapper)) == ids([inner])


def test_z3_leaf_parameter() -> None:
    p = nn.Parameter(torch.ones(2))
    assert not z3_leaf_parameter(p)
    p.ds_z3_leaf_module = nn.Linear(1, 1)
    assert z3_leaf_parameter(p)


# --- by class -----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Block, "Block", f"{__name__}.Block"])
def test_set_by_class_or_name(model: Model, cls: type[nn.Module] | str) -> None:
    leaves = set_z3_leaf_modules(model, [cls])
    assert ids(leaves) == ids([model.blocks[0], model.blocks[1]])
    assert marked(model) == {"blocks.0", "blocks.1"}
    assert ids(get_z3_leaf_modules(model)) == ids(leaves)


def test_class_matches_subclasses_but_name_does_not() -> None:
    model = Model(block=SubBlock)
    assert len(set_z3_leaf_modules(model, [Block])) == 2
    unset_z3_leaf_modules(model, [Block])
    assert set_z3_leaf_modules(model, ["Block"], raise_if_not_found=False) == []
    assert len(set_z3_leaf_modules(model, ["SubBlock"])) == 2


def test_set_by_class_includes_the_root_and_returns_pre_order(model: Model) -> None:
    leaves = set_z3_leaf_modules(model, [nn.Linear, Model])
    expected = [model, model.blocks[0].fc, model.blocks[1].fc, model.head]
    assert ids(leaves) == ids(expected)
    assert ids(get_z3_leaf_modules(model)) == ids(expected)


def test_unknown_class_raises_naming_it(model: Model) -> None:
    class Missing(nn.Module):
        pass

    with pytest.raises(ValueError, match=r"Missing, 'NoSuchBlock'.*model Model"):
        set_z3_leaf_modules(model, [Missing, "NoSuchBlock"])
    assert marked(model) == set()


def test_partly_unknown_classes_mark_the_known(model: Model) -> None:
    leaves = set_z3_leaf_modules(model, ["NoSuchBlock", nn.Embedding])
    assert ids(leaves) == ids([model.embed])


def test_unknown_class_without_raise(model: Model) -> None:
    assert set_z3_leaf_modules(model, ["NoSuchBlock"], raise_if_not_found=False) == []
    assert unset_z3_leaf_modules(model, ["NoSuchBlock"], raise_if_not_found=False) == []
    assert marked(model) == set()


def test_unset_by_class(model: Model) -> None:
    set_z3_leaf_modules(model, [Block, nn.Embedding])
    unset = unset_z3_leaf_modules(model, ["Block"])
    assert ids(unset) == ids([model.blocks[0], model.blocks[1]])
    assert marked(model) == {"embed"}
    with pytest.raises(ValueError, match="NoSuchBlock"):
        unset_z3_leaf_modules(model, ["NoSuchBlock"])


@pytest.mark.parametrize("bad", ["Block", Block, {"Block"}])
def test_classes_must_be_a_list(model: Model, bad: object) -> None:
    with pytest.raises(TypeError, match="list of classes or class names"):
        set_z3_leaf_modules(model, bad)  # type: ignore[arg-type]


def test_class_entries_must_be_classes_or_names(model: Model) -> None:
    with pytest.raises(TypeError, match=r"got \[3\]"):
        set_z3_leaf_modules(model, [Block, 3])  # type: ignore[list-item]


# --- by name and suffix -------------------------------------------------------------------


def test_set_by_name(model: Model) -> None:
    leaves, missing = set_z3_leaf_modules_by_name(model, ["head", "blocks.1"])
    assert ids(leaves) == ids([model.head, model.blocks[1]])
    assert missing == []
    assert marked(model) == {"head", "blocks.1"}
    assert ids(get_z3_leaf_modules(model)) == ids([model.blocks[1], model.head])


def test_set_by_name_root_and_repeats(model: Model) -> None:
    leaves, _ = set_z3_leaf_modules_by_name(model, ["", "head", "head"])
    assert ids(leaves) == ids([model, model.head])


def test_unset_by_name(model: Model) -> None:
    set_z3_leaf_modules_by_name(model, ["head", "embed"])
    leaves, _ = set_z3_leaf_modules_by_name(model, ["head"], flag=False)
    assert ids(leaves) == ids([model.head])
    assert marked(model) == {"embed"}


def test_unknown_name_raises_listing_them_and_marks_nothing(model: Model) -> None:
    with pytest.raises(ValueError, match=r"\['nope', 'blocks\.7'\].*model Model"):
        set_z3_leaf_modules_by_name(model, ["head", "nope", "blocks.7"])
    assert marked(model) == set()


def test_unknown_name_without_raise(model: Model) -> None:
    leaves, missing = set_z3_leaf_modules_by_name(
        model, ["nope", "embed"], raise_if_not_found=False
    )
    assert ids(leaves) == ids([model.embed])
    assert missing == ["nope"]
    assert marked(model) == {"embed"}


def test_shared_module_answers_to_each_name() -> None:
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"a": shared, "b": shared})
    leaves, missing = set_z3_leaf_modules_by_name(model, ["b"])
    assert ids(leaves) == ids([shared])
    assert missing == []


def test_set_by_suffix(model: Model) -> None:
    leaves, missing = set_z3_leaf_modules_by_suffix(model, ["fc", "0.fc", "head"])
    assert ids(leaves) == ids([model.blocks[0].fc, model.blocks[1].fc, model.head])
    assert missing == []
    assert marked(model) == {"blocks.0.fc", "blocks.1.fc", "head"}
    assert ids(get_z3_leaf_modules(model)) == ids(leaves)


def test_suffix_is_a_plain_string_suffix(model: Model) -> None:
    leaves, _ = set_z3_leaf_modules_by_suffix(model, ["ad"])  # as in DeepSpeed: "head" matches
    assert ids(leaves) == ids([model.head])


def test_unset_by_suffix(model: Model) -> None:
    set_z3_leaf_modules(model, [nn.Linear])
    set_z3_leaf_modules_by_suffix(model, ["fc"], flag=False)
    assert marked(model) == {"head"}


def test_unmatched_suffix_raises_listing_them_and_marks_nothing(model: Model) -> None:
    with pytest.raises(ValueError, match=r"suffixes \['mlp'\]"):
        set_z3_leaf_modules_by_suffix(model, ["fc", "mlp"])
    assert marked(model) == set()
    leaves, missing = set_z3_leaf_modules_by_suffix(model, ["fc", "mlp"], raise_if_not_found=False)
    assert ids(leaves) == ids([model.blocks[0].fc, model.blocks[1].fc])
    assert missing == ["mlp"]
    assert marked(model) == {"blocks.0.fc", "blocks.1.fc"}


@pytest.mark.parametrize("fn", [set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix])
def test_names_must_be_a_list_of_str(model: Model, fn) -> None:
    with pytest.raises(TypeError, match="expected a list of str"):
        fn(model, "head")
    with pytest.raises(TypeError, match=r"must be str, got \[1\]"):
        fn(model, ["head", 1])


# --- granularity ---------------------------------------------------------------------------


def test_threshold_zero_marks_nothing(model: Model, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="zpartition")
    assert leaf_modules_by_granularity(model, 0) == []
    assert marked(model) == set()
    assert caplog.records == []


@pytest.mark.parametrize("threshold", [BLOCK_G, ROOT_G - 1])
def test_threshold_selects_the_blocks(model: Model, threshold: int) -> None:
    leaves = leaf_modules_by_granularity(model, threshold)
    assert ids(leaves) == ids([model.blocks[0], model.blocks[1]])
    assert marked(model) == {"blocks.0", "blocks.1"}


@pytest.mark.parametrize("threshold", [ROOT_G, 10**12, sys.maxsize])
def test_large_threshold_selects_the_root_only(model: Model, threshold: int) -> None:
    leaves = leaf_modules_by_granularity(model, threshold)
    assert ids(leaves) == ids([model])
    assert marked(model) == {""}  # pre-order: nothing below the chosen root


def test_containers_are_never_leaves() -> None:
    class Blocks(nn.ModuleList):  # a subclassed container is no more callable
        pass

    blocks = [Block() for _ in range(4)]
    model = nn.Sequential(
        blocks[0], nn.ModuleList([blocks[1]]), nn.ModuleDict({"b": blocks[2]}), Blocks([blocks[3]])
    )
    assert ids(leaf_modules_by_granularity(model, sys.maxsize)) == ids(blocks)
    assert marked(model) == {"0", "1.0", "2.b", "3.0"}


def test_parameter_lists_and_childless_modules_are_never_leaves() -> None:
    model = nn.ModuleList([nn.Linear(2, 2), nn.ParameterList([nn.Parameter(torch.ones(3))])])
    assert leaf_modules_by_granularity(model, sys.maxsize) == []


class Acts(nn.Module):
    """A non-container module with children but no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.gelu = nn.GELU()
        self.relu = nn.ReLU()


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.acts = Acts()
        self.block = Block()


def test_modules_without_parameters_are_skipped(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="zpartition")
    model = nn.ModuleList([Holder(), Acts()])
    # Holder: 88 elements in 3 (block) + 0 (acts, skipped) + 1 layers = 22.
    assert ids(leaf_modules_by_granularity(model, sys.maxsize)) == ids([model[0]])
    unset_z3_leaf_modules(model, [Holder])
    assert leaf_modules_by_granularity(model, 21) == []
    assert "[Holder:22]" in caplog.text
    assert marked(model) == set()


def test_partitioned_parameters_are_measured_by_ds_numel(model: Model) -> None:
    for p in model.parameters():
        p.ds_numel = p.numel()
        p.data = torch.empty(0)  # as after partitioning
    assert ids(leaf_modules_by_granularity(model, BLOCK_G)) == ids(list(model.blocks))


def test_custom_numel(model: Model) -> None:
    # One element per parameter: Block 4 // 3 = 1; root (1 + 8 + 2) // 9 = 1.
    assert ids(leaf_modules_by_granularity(model, 1, numel=lambda p: 1)) == ids([model])


def test_oversized_modules_are_never_leaves(model: Model, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="zpartition")
    assert leaf_modules_by_granularity(model, sys.maxsize, numel=lambda p: 10**9) == []
    assert marked(model) == set()
    assert "no module can be a leaf" in caplog.text


def test_threshold_below_smallest_warns(model: Model, caplog) -> None:
    caplog.set_level(logging.INFO, logger="zpartition")
    assert leaf_modules_by_granularity(model, BLOCK_G - 1) == []
    assert marked(model) == set()
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert f"smallest module granularity is [Block:{BLOCK_G}]" in record.getMessage()
    assert f">= {BLOCK_G}" in record.getMessage()


def test_chosen_leaves_are_logged(model: Model, caplog) -> None:
    caplog.set_level(logging.INFO, logger="zpartition")
    leaf_modules_by_granularity(model, BLOCK_G)
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert "blocks.0 (Block: 29), blocks.1 (Block: 29)" in record.getMessage()


def test_granularity_adds_to_existing_marks(model: Model) -> None:
    set_z3_leaf_modules_by_name(model, ["head"])
    leaf_modules_by_granularity(model, BLOCK_G)
    assert marked(model) == {"blocks.0", "blocks.1", "head"}
