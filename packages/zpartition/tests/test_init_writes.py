"""Init: initialisation written after a child module was cut reaches its parameters.

The models end their ``__init__`` as Hugging Face's ``post_init`` does: a recursion of their own
(not ``nn.Module.apply``) that initialises every module's weights, when the children are already
partitioned. Built under `Init`, they must hold exactly the values of the same model built
without it, with the same seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import GatheredParameters, ZeroParamConfig, ZeroParamStatus
from zpartition._gather import channel_for

from ._helpers import TinyGPT, batches, reference_losses, train_partitioned

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
VOCAB, HIDDEN, PAD = 40, 16, 3


def _post_init(module: nn.Module, fn: Callable[[nn.Module], None]) -> None:
    """Children first, then the module: Transformers' ``smart_apply``, not ``nn.Module.apply``."""
    for child in module.children():
        _post_init(child, fn)
    fn(module)


class Gain(nn.Module):
    """A module with a bare parameter, initialised through ``.data``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(HIDDEN))


class Net(nn.Module):
    """Every kind of write a post-construction init makes, on already partitioned children."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(8, HIDDEN)
        self.kind = nn.Embedding(4, HIDDEN)
        self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(blocks))
        self.xavier = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.ortho = nn.Linear(8, 8, bias=False)
        self.conv = nn.Conv1d(4, 6, 3)
        self.conv2 = nn.Conv1d(6, 4, 3, bias=False)
        self.conv3 = nn.Conv1d(4, 4, 1, bias=False)
        self.norm = nn.LayerNorm(HIDDEN)
        self.gain = Gain()
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.bias = nn.Parameter(torch.zeros(VOCAB))  # the top's own: not cut yet here
        with torch.no_grad():  # as Transformers' initialize_weights
            _post_init(self, self._init_weights)
            self.head.weight.copy_(self.embed.weight)  # tied-weight style: both partitioned

    def _init_weights(self, module: nn.Module) -> None:
        init = torch.nn.init
        if module is self.xavier:
            init.xavier_uniform_(module.weight)  # reads the shape before it writes
            init.uniform_(module.bias, -0.1, 0.1)
        elif module is self.ortho:
            init.orthogonal_(module.weight)
        elif isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=0.02)
            bias: torch.Tensor | None = module.bias
            if bias is not None:
                init.zeros_(bias)
                bias += 0.25  # an in-place operator
        elif module is self.conv:
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))  # dispatched whole
            assert module.bias is not None
            init.zeros_(module.bias)
        elif module is self.conv2:
            init.trunc_normal_(module.weight, std=0.5)  # reads is_meta first
        elif module is self.conv3:
            init.kaiming_normal_(module.weight, mode="fan_out")
        elif module is self.embed:
            init.normal_(module.weight)
            init.zeros_(module.weight[PAD])  # a view of the held weight, written after
        elif module is self.pos:
            module.weight[PAD].zero_()  # the index gathers
        elif module is self.kind:
            module.weight[1] = 0.5
        elif isinstance(module, nn.LayerNorm):
            assert module.bias is not None
            shift: torch.Tensor = module.bias
            shift += 0.1  # an in-place operator gathers
            init.ones_(module.weight)
        elif isinstance(module, Gain):
            module.scale.data.normal_()
        elif module is self:
            self.bias.fill_(0.5)


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full values (tied ones once, as named first)."""
    with GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_same(model: nn.Module, reference: nn.Module) -> None:
    got, expected = _values(model), dict(reference.named_parameters())
    assert got.keys() == expected.keys()
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name


class TestWritesAfterConstruction(DistributedTest):
    @SIZES
    def test_same_values_as_without_init(self, world_size: int) -> None:
        torch.manual_seed(0)
        reference = Net()
        torch.manual_seed(0)
        with zpartition.Init():
            model = Net()
        for p in model.parameters():
            assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
        _assert_same(model, reference)
        assert torch.equal(reference.embed.weight[PAD], torch.zeros(HIDDEN))  # the test bites
        assert torch.equal(reference.head.weight, reference.embed.weight)

    @SIZES
    def test_every_rank_keeps_rank_0s_values(self, world_size: int) -> None:
        torch.manual_seed(1234)
        reference = Net()  # what rank 0 draws
        torch.manual_seed(1234 + zcomm.get_rank())  # the other ranks draw other values
        with zpartition.Init():
            model = Net()
        _assert_same(model, reference)

    @SIZES
    def test_at_most_one_operations_parameters_are_held(self, world_size: int) -> None:
        channel = channel_for(None)
        before = channel.live_numel
        channel.peak_live_numel = before
        torch.manual_seed(0)
        with zpartition.Init():
            model = Net(blocks=8)
        assert channel.live_numel == before  # nothing left gathered
        numel = {name: p.numel() for name, p in Net(blocks=8).named_parameters()}
        units = [
            sum(n for name, n in numel.items() if name.rsplit(".", 1)[0] == module)
            for module in {name.rsplit(".", 1)[0] for name in numel if "." in name}
        ]
        copy = numel["embed.weight"] + numel["head.weight"]  # the one op naming two units
        assert channel.peak_live_numel - before == max(copy, *units)
        assert channel.peak_live_numel - before < sum(numel.values()) / 3
        assert all(_status(p) is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())

    @SIZES
    def test_a_failing_write_releases_what_it_gathered(self, world_size: int) -> None:
        channel = channel_for(None)
        before = channel.live_numel

        class Grads(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = nn.Linear(3, 3)
                self.inner.weight.normal_()  # in place on a leaf that requires grad

        with (
            pytest.raises(RuntimeError, match="leaf Variable that requires grad"),
            zpartition.Init(),
        ):
            Grads()
        assert channel.live_numel == before
        assert torch._C._len_torch_function_stack() == 0


class TestTheModeStaysOutOfTheWay(DistributedTest):
    @SIZES
    def test_nested_contexts_push_one_mode(self, world_size: int) -> None:
        assert torch._C._len_torch_function_stack() == 0
        with zpartition.Init():
            assert torch._C._len_torch_function_stack() == 1
            with zpartition.Init(), zpartition.Init(enabled=False):
                assert torch._C._len_torch_function_stack() == 1
                inner = nn.Linear(4, 4)
            outer = nn.Linear(4, 4)
            with torch.no_grad():
                inner.weight.fill_(2.0)
                outer.weight.fill_(3.0)
            assert inner.weight.shape == (0,)  # shape reads are not intercepted
        assert torch._C._len_torch_function_stack() == 0
        with GatheredParameters([inner.weight, outer.weight]):
            assert torch.equal(inner.weight, torch.full((4, 4), 2.0))
            assert torch.equal(outer.weight, torch.full((4, 4), 3.0))

    @SIZES
    def test_gathered_parameters_and_apply_inside_init(self, world_size: int) -> None:
        """DeepSpeed's own way (a `GatheredParameters` block in a parent's ``__init__``) and
        ``apply`` still work beside the mode, and mix with its writes."""

        class Parent(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.first = nn.Linear(4, 4)
                self.second = nn.Linear(4, 4)
                with torch.no_grad():
                    self.first.weight.fill_(1.0)  # held by the mode...
                    with GatheredParameters(self.second.weight, modifier_rank=0):
                        self.second.weight.data.copy_(self.first.weight + 1.0)
                    self.first.bias.zero_()  # ...and still held: no gather
                self.apply(self._bias)

            def _bias(self, module: nn.Module) -> None:
                if module is self.second:
                    assert isinstance(module, nn.Linear)
                    module.bias.data.fill_(7.0)

        with zpartition.Init():
            model = Parent()
        with GatheredParameters(list(model.parameters())):
            assert torch.equal(model.first.weight, torch.ones(4, 4))
            assert torch.equal(model.first.bias, torch.zeros(4))
            assert torch.equal(model.second.weight, torch.full((4, 4), 2.0))
            assert torch.equal(model.second.bias, torch.full((4,), 7.0))

    @SIZES
    def test_training_inside_the_context(self, world_size: int) -> None:
        """The hooks' gathers and releases run inside `Init` untouched by the mode."""
        torch.manual_seed(1234)
        reference = TinyGPT()
        torch.manual_seed(1234)
        data = batches(3, 8)
        with zpartition.Init():
            model = TinyGPT()
            config = ZeroParamConfig(param_persistence_threshold=0)
            handle = zpartition.partition(model, config=config)
            losses = train_partitioned(model, handle.shard_parameters(), data, 0.1)
        torch.testing.assert_close(
            losses, reference_losses(reference, data, 0.1), rtol=1e-5, atol=1e-6
        )


def _status(param: torch.Tensor) -> ZeroParamStatus:
    status: ZeroParamStatus = param.ds_status
    return status


class TestUnderOtherModes(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_a_device_context_inside_init(self, world_size: int) -> None:
        """``torch.device(...)`` is a mode too; pushed above this one, it calls in between."""
        torch.manual_seed(0)
        reference = Net()
        torch.manual_seed(0)
        with zpartition.Init(), torch.device("cpu"):
            model = Net()
        _assert_same(model, reference)
