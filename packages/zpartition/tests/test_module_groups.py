"""Module groups ([Note: module groups]): small modules under one parent gathered as one unit,
chosen by size, with nothing of a unit per module lost: training equals plain PyTorch, a
submodule called from outside its group and a parameter read from another module are gathered,
external parameters registered inside a group are gathered with it, the live limit holds, and
frozen parameters of a group can be kept as codes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import zpartition
from zcomm.testing import DistributedTest
from zpartition import ZeroParamConfig

from ._helpers import (
    HIDDEN,
    VOCAB,
    Block,
    TinyGPT,
    batches,
    externals,
    reference_losses,
    train_partitioned,
)

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
NOT_PERSISTENT: dict[str, Any] = {"param_persistence_threshold": 0}


def _unit_names(handle: zpartition.Partitioned) -> list[str]:
    return [u.name for u in handle.units if not u.persistent]


class ReachesIn(nn.Module):
    """The root calls a submodule of block 0 itself, and reads block 1's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        first, second = _block(self, 0), _block(self, 1)
        x = x + first.up(x)[..., :HIDDEN]  # outside its block's forward
        x = x @ second.down.weight[:, :HIDDEN]  # read by the root
        return _loss(self.norm(x) @ self.embed.weight.t(), tokens)


class BorrowingLinear(nn.Linear):
    """Adds a module's bias it does not own (the module is kept in a list: not a child)."""

    def __init__(self, lender: nn.Linear) -> None:
        super().__init__(HIDDEN, 3 * HIDDEN)
        self.lender = [lender]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = super().forward(x) + self.lender[0].bias.sum()
        return out


class Borrowing(nn.Module):
    """Block 1's ``up`` adds block 0's ``down.bias``, registered as its external parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        _block(self, 1).up = BorrowingLinear(_block(self, 0).down)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return _loss(x @ self.embed.weight.t(), tokens)


def _block(model: nn.Module, i: int) -> Block:
    block = model.get_submodule(f"blocks.{i}")
    assert isinstance(block, Block)
    return block


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, dims=1).flatten())


ONE = pytest.mark.parametrize("world_size", [1])


class Attention(nn.Module):
    """No parameters of its own, plain layers below: hidden in its layer's group."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.o = nn.Linear(HIDDEN, HIDDEN)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.norm = nn.LayerNorm(HIDDEN)


class Owning(nn.Linear):
    """Parameters of its own and a child: a group itself, never hidden in its parent's."""

    def __init__(self) -> None:
        super().__init__(HIDDEN, HIDDEN)
        self.inner = nn.Linear(HIDDEN, HIDDEN)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = Layer()
        self.holder = nn.Module()
        self.holder.owning = Owning()
        self.holder.other = nn.Linear(HIDDEN, HIDDEN)


class Adapted(nn.Module):
    """PEFT LoRA's layer: a frozen base, its adapters in ``ModuleDict``s, nothing of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.base_layer = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.lora_dropout = nn.ModuleDict({"default": nn.Identity()})
        self.lora_A = nn.ModuleDict({"default": nn.Linear(HIDDEN, 4, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(4, HIDDEN, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter = self.lora_B["default"](self.lora_A["default"](self.lora_dropout["default"](x)))
        out: torch.Tensor = self.base_layer(x) + adapter
        return out


class Experts(nn.Module):
    """A fused MoE's experts (Transformers 5's Mixtral): one 3-D weight of its own, its
    activation a child; a token goes to the expert its routing picks."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, HIDDEN, HIDDEN) / HIDDEN**0.5)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return self.act_fn(torch.einsum("...h,...hk->...k", x, self.weight[chosen]))


class AdaptedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = Adapted()
        self.o = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.o(torch.tanh(self.q(x)))
        return out


class Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, 3, bias=False)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x).argmax(-1))


class Sublayer(nn.Module):
    """A T5 block's part: a norm, then attention or the MoE, residual."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(HIDDEN)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.inner(self.layer_norm(x))
        return out


class DeepBlock(nn.Module):
    """T5's block: a ``ModuleList`` of sublayers (one class here, unlike below), three levels
    above the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Sublayer(AdaptedAttention()), Sublayer(Moe())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.layer:
            x = part(x)
        return x


class Body(nn.Module):
    """Without parameters of its own, over a stack of `DeepBlock`s (a Transformers model's
    body)."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(DeepBlock() for _ in range(blocks))


class DeepModel(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.body = Body(blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.body.embed(tokens)
        for block in self.body.blocks:
            x = block(x)
        return _loss(x @ self.body.embed.weight.t(), tokens)


# each block twice: its trainable parameters and its frozen ones ([Note: module groups])
DEEP_UNITS = ["body.embed", *(f"body.blocks.{i}" for i in (0, 0, 1, 1))]


class ExpertMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, HIDDEN)
        self.down = nn.Linear(HIDDEN, HIDDEN)


class ListedExperts(nn.Module):
    """A MoE block whose experts are a list of alike modules: a stack."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, 2)
        self.experts = nn.ModuleList(ExpertMlp() for _ in range(2))


class TestFormation(DistributedTest):
    @ONE
    def test_blocks_are_units_and_the_root_and_containers_never(self, world_size: int) -> None:
        handle = zpartition.partition(TinyGPT(blocks=3), config=ZeroParamConfig(**NOT_PERSISTENT))
        # the root's bias, each one-module child alone, a unit per block: no ModuleList group
        blocks = [f"blocks.{i}" for i in range(3)]
        assert _unit_names(handle) == ["<root>", "embed", *blocks, "norm"]
        handle.remove()

    @ONE
    def test_a_group_reaches_two_levels_through_modules_without_parameters(
        self, world_size: int
    ) -> None:
        handle = zpartition.partition(Nested(), config=ZeroParamConfig(**NOT_PERSISTENT))
        assert _unit_names(handle) == ["layer", "holder.owning", "holder.other"]
        handle.remove()

    @ONE
    def test_blocks_group_at_any_depth_but_never_a_stack(self, world_size: int) -> None:
        """A LoRA layer's ModuleDicts, a T5 block's ModuleList of sublayers, fused experts with
        an activation child: one group per block; the body above the blocks' list is no group,
        and a MoE block's list of alike experts is a stack, each expert a group."""
        handle = zpartition.partition(DeepModel(), config=ZeroParamConfig(**NOT_PERSISTENT))
        assert _unit_names(handle) == DEEP_UNITS
        # a block's frozen base is a unit apart, the rest of the block the other
        frozen = [u for u in handle.units if not u.trainable]
        assert [(u.name, len(u.params)) for u in frozen] == [
            ("body.blocks.0", 2),
            ("body.blocks.1", 2),
        ]
        handle.remove()
        handle = zpartition.partition(ListedExperts(), config=ZeroParamConfig(**NOT_PERSISTENT))
        assert _unit_names(handle) == ["gate", "experts.0", "experts.1"]
        handle.remove()

    @ONE
    def test_zero_or_a_small_size_keeps_a_unit_per_module(self, world_size: int) -> None:
        modules = [f"blocks.{i}.{m}" for i in range(2) for m in ("norm", "up", "down")]
        per_module = ["<root>", "embed", *modules, "norm"]
        for size in (0, 3 * HIDDEN * HIDDEN):  # below a block: its modules stay apart
            config = ZeroParamConfig(**NOT_PERSISTENT, module_group_size=size)
            handle = zpartition.partition(TinyGPT(blocks=2), config=config)
            assert _unit_names(handle) == per_module, size
            handle.remove()

    @ONE
    def test_a_group_is_at_most_half_the_live_limit(self, world_size: int) -> None:
        block = sum(p.numel() for p in TinyGPT(blocks=1).blocks[0].parameters())
        for live, grouped in ((2 * block, True), (2 * block - 1, False)):
            config = ZeroParamConfig(**NOT_PERSISTENT, max_live_parameters=live)
            handle = zpartition.partition(TinyGPT(blocks=1), config=config)
            assert ("blocks.0" in _unit_names(handle)) is grouped, live
            handle.remove()


class TestConfig:
    def test_the_size_is_checked(self) -> None:
        with pytest.raises(ValueError, match="module_group_size must be >= 0"):
            ZeroParamConfig(module_group_size=-1)
        json_like = ZeroParamConfig(module_group_size=1e6)  # type: ignore[arg-type]
        assert json_like.module_group_size == 10**6


class TestTraining(DistributedTest):
    @SIZES
    def test_reaching_into_a_group_from_outside_trains_as_plain(self, world_size: int) -> None:
        torch.manual_seed(0)
        built = ReachesIn()
        model = copy.deepcopy(built)
        handle = zpartition.partition(model, config=ZeroParamConfig(**NOT_PERSISTENT))
        assert _unit_names(handle) == ["embed", "blocks.0", "blocks.1", "norm"]
        data = batches(3, 4 * world_size)
        losses = train_partitioned(model, handle.shard_parameters(), data, lr=0.1)
        assert losses == pytest.approx(reference_losses(built, data, lr=0.1), rel=1e-5)
        # each was found as it was read, and registered with the module running: the root
        found = {id(p) for p in externals(model).values()}
        assert {id(_block(model, 0).up.weight), id(_block(model, 1).down.weight)} <= found

    @pytest.mark.parametrize("world_size", [2])
    def test_deep_blocks_train_as_plain(self, world_size: int) -> None:
        """Blocks grouped through ModuleLists and ModuleDicts, frozen bases beside trainable
        adapters, fused experts picked per token: the losses of plain PyTorch."""
        torch.manual_seed(0)
        built = DeepModel()
        model = copy.deepcopy(built)
        handle = zpartition.partition(model, config=ZeroParamConfig(**NOT_PERSISTENT))
        assert _unit_names(handle) == DEEP_UNITS
        data = batches(3, 4 * world_size)
        losses = train_partitioned(model, handle.shard_parameters(), data, lr=0.1)
        expected = reference_losses(built, data, lr=0.1)
        assert len(set(expected)) == len(expected)  # it trains
        assert losses == pytest.approx(expected, rel=1e-5)

    @pytest.mark.parametrize("world_size", [2])
    def test_externals_registered_inside_a_group_are_gathered_with_it(
        self, world_size: int
    ) -> None:
        torch.manual_seed(0)
        built = Borrowing()
        model = copy.deepcopy(built)
        handle = zpartition.partition(model, config=ZeroParamConfig(**NOT_PERSISTENT))
        zpartition.register_external_parameter(_block(model, 1).up, _block(model, 0).down.bias)
        data = batches(3, 4 * world_size)
        losses = train_partitioned(model, handle.shard_parameters(), data, lr=0.1)
        assert losses == pytest.approx(reference_losses(built, data, lr=0.1), rel=1e-5)
        # block 1 fetched block 0 for its member's registration: no read had to find it
        assert externals(_block(model, 1)) == {}
        assert handle.coordinator.invalidations == 0

    @pytest.mark.parametrize("world_size", [2])
    def test_frozen_parameters_of_a_group_are_kept_as_codes(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT(blocks=2)
        for block in model.blocks:
            block.up.requires_grad_(False)  # a frozen base beside trainable layers
        config = ZeroParamConfig(**NOT_PERSISTENT, quantized_nontrainable_weights=True)
        handle = zpartition.partition(model, config=config)
        frozen = [u for u in handle.units if u.codes is not None]
        assert [u.name for u in frozen] == ["blocks.0", "blocks.1"]
        assert all(not u.trainable for u in frozen)
        assert {id(p) for u in frozen for p in u.params} == {
            id(p) for b in model.blocks for p in b.up.parameters()
        }
        losses = train_partitioned(model, handle.shard_parameters(), batches(2, 8), lr=0.1)
        assert all(torch.isfinite(torch.tensor(losses)))
