"""Init (partition while building) and GatheredParameters (full parameters in a block)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import GatheredParameters, ZeroParamConfig, ZeroParamStatus

from ._helpers import TinyGPT, batches, externals, reference_losses, train_partitioned

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])


def _status(param: torch.Tensor) -> ZeroParamStatus:
    status: ZeroParamStatus = param.ds_status  # read anew: mypy would keep an earlier narrowing
    return status


class Outer(nn.Module):
    """Builds a child inside its __init__ and reads its own parameter there (full, not yet cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 5)
        self.scale = nn.Parameter(torch.randn(5, 3))
        self.seen_in_init = self.scale.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) @ self.scale


def _build_on_rank0_values(factory: type[nn.Module]) -> nn.Module:
    """What every rank's partitioned values must equal: rank 0's build with the same seed."""
    torch.manual_seed(1234)
    return factory()


class TestInit(DistributedTest):
    @SIZES
    def test_parameters_are_cut_as_modules_are_built(self, world_size: int) -> None:
        expected = _build_on_rank0_values(Outer)
        torch.manual_seed(1234 + zcomm.get_rank())  # ranks draw different values...
        with zpartition.Init():
            model = Outer()
        assert model.seen_in_init == 15  # ...parents see full parameters in their __init__
        for p, ref in zip(model.parameters(), expected.parameters(), strict=True):
            assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
            assert p.numel() == 0
            assert p.ds_tensor.numel() == math.ceil(ref.numel() / world_size)
        with GatheredParameters(list(model.parameters())):  # ...and all keep rank 0's
            for p, ref in zip(model.parameters(), expected.parameters(), strict=True):
                torch.testing.assert_close(p.data, ref.data)
        assert Outer.__init__.__name__ == "__init__"
        assert not hasattr(Outer.__init__, "__wrapped__")

    @SIZES
    def test_trains_like_the_unpartitioned_model(self, world_size: int) -> None:
        reference = _build_on_rank0_values(TinyGPT)
        torch.manual_seed(1234)
        with zpartition.Init():
            model = TinyGPT()
        handle = zpartition.partition(model, config=ZeroParamConfig(param_persistence_threshold=0))
        data = batches(3, 8)
        losses = train_partitioned(model, handle.shard_parameters(), data, 0.1)
        torch.testing.assert_close(
            losses, reference_losses(reference, data, 0.1), rtol=1e-5, atol=1e-6
        )

    @SIZES
    def test_nested_disabled_dtype_and_remote_device(self, world_size: int) -> None:
        with zpartition.Init(enabled=False):
            plain = nn.Linear(3, 3)
        assert not zpartition.is_zero_param(plain.weight)
        assert plain.weight.shape == (3, 3)
        with zpartition.Init(dtype=torch.bfloat16, remote_device="cpu"):
            with zpartition.Init():
                nested = nn.Linear(3, 3)
            after = nn.Linear(3, 3)
        for p in (*nested.parameters(), *after.parameters()):
            assert zpartition.is_zero_param(p)
        assert after.weight.ds_tensor.dtype == torch.bfloat16
        assert after.weight.ds_tensor.device.type == "cpu"
        with pytest.raises(TypeError, match="a DeepSpeed config goes to zengine"):
            zpartition.Init(config={"fp16": {"enabled": True}})  # type: ignore[arg-type]
        late = nn.Linear(2, 2)  # after the context: plain again
        assert not zpartition.is_zero_param(late.weight)

    @SIZES
    def test_module_argument_partitions_a_built_model(self, world_size: int) -> None:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        zpartition.Init(module=model)
        assert all(zpartition.is_zero_param(p) for p in model.parameters())

    @pytest.mark.parametrize("world_size", [1])
    def test_bad_remote_device(self, world_size: int) -> None:
        with pytest.raises(ValueError, match="remote_device='nvme'"):
            zpartition.Init(remote_device="nvme")


class Rewrites(Outer):
    """Writes a child's weight after the child was cut (caught by the write mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner.weight.data.normal_()


def _own_chunk(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """`rank`'s chunk of `full` flattened, zero-padded to ceil(numel / world)."""
    chunk = math.ceil(full.numel() / world)
    out = torch.zeros(chunk, dtype=full.dtype)
    mine = full.reshape(-1)[rank * chunk : (rank + 1) * chunk]
    out[: mine.numel()] = mine
    return out


def _broadcasts_while(build: Callable[[], nn.Module]) -> tuple[nn.Module, int]:
    """`build()`, and how many broadcasts zcomm recorded meanwhile."""
    zcomm.reset_comm_accounting()
    zcomm.enable_comm_accounting()
    try:
        model = build()
        stats = zcomm.comm_summary().get("broadcast")
    finally:  # the pool's worker runs other tests next
        zcomm.enable_comm_accounting(False)
        zcomm.reset_comm_accounting()
    return model, stats.count if stats is not None else 0


class TestSyncModuleStates(DistributedTest):
    @SIZES
    def test_by_default_each_module_is_broadcast(self, world_size: int) -> None:
        expected = _build_on_rank0_values(Outer)

        def build() -> nn.Module:
            torch.manual_seed(1234 + zcomm.get_rank())
            with zpartition.Init():
                return Outer()

        model, broadcasts = _broadcasts_while(build)
        assert (broadcasts > 0) == (world_size > 1)  # one rank has nothing to agree on
        with GatheredParameters(list(model.parameters())):  # rank 0's values everywhere
            for p, ref in zip(model.parameters(), expected.parameters(), strict=True):
                assert torch.equal(p.data, ref.data)

    @SIZES
    def test_off_each_rank_keeps_its_own_slice(self, world_size: int) -> None:
        rank = zcomm.get_rank()
        torch.manual_seed(1234 + rank)  # ranks draw different values
        own = Outer()

        def build() -> nn.Module:
            torch.manual_seed(1234 + rank)
            with zpartition.Init(sync_module_states=False):
                return Outer()

        model, broadcasts = _broadcasts_while(build)
        assert broadcasts == 0
        for p, ref in zip(model.parameters(), own.parameters(), strict=True):
            assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
            assert torch.equal(p.ds_tensor, _own_chunk(ref.data, rank, world_size))
        torch.manual_seed(99)  # the same on every rank: what a checkpoint holds
        loaded = Outer()
        with GatheredParameters(list(model.parameters()), modifier_rank=0):
            if rank == 0:  # a load: rank 0 writes every weight
                for p, value in zip(model.parameters(), loaded.parameters(), strict=True):
                    p.data.copy_(value.data)
        with GatheredParameters(list(model.parameters())):
            for p, value in zip(model.parameters(), loaded.parameters(), strict=True):
                assert torch.equal(p.data, value.data)

    @SIZES
    def test_off_writes_after_construction_keep_rank_0s_values(self, world_size: int) -> None:
        torch.manual_seed(1234)  # what rank 0 builds and then writes
        Outer()
        written = torch.empty(5, 6).normal_()
        rank = zcomm.get_rank()
        torch.manual_seed(1234 + rank)
        own = Outer()
        torch.manual_seed(1234 + rank)
        with zpartition.Init(sync_module_states=False):
            model = Rewrites()
        # not written: this rank's slice of its own draw
        assert torch.equal(model.scale.ds_tensor, _own_chunk(own.scale.data, rank, world_size))
        with GatheredParameters(list(model.parameters())):
            assert torch.equal(model.inner.weight.data, written)  # written: rank 0's, everywhere


class TestGatheredParameters(DistributedTest):
    @SIZES
    def test_modifier_rank_changes_are_kept_everywhere(self, world_size: int) -> None:
        model = nn.Linear(5, 3)
        zpartition.partition(model, config=ZeroParamConfig(param_persistence_threshold=0))
        modifier = world_size - 1
        with GatheredParameters(model.weight, modifier_rank=modifier):
            assert model.weight.shape == (3, 5)
            if zcomm.get_rank() == modifier:
                model.weight.data.fill_(7.0)
        assert model.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
        with GatheredParameters(model.parameters()):
            assert torch.equal(model.weight.data, torch.full((3, 5), 7.0))
        out = model(torch.ones(1, 5))
        assert out.shape == (1, 3)

    @SIZES
    def test_without_modifier_changes_are_dropped_and_raise(self, world_size: int) -> None:
        model = nn.Linear(5, 3)
        zpartition.partition(model, config=ZeroParamConfig(param_persistence_threshold=0))
        before = {}

        def change() -> None:
            with GatheredParameters(model.weight):
                before["weight"] = model.weight.data.clone()
                model.weight.data.add_(1.0)

        with pytest.raises(zpartition.DiscardedChangeError):  # [Note: discarded changes]
            change()
        with GatheredParameters(model.weight):
            assert torch.equal(model.weight.data, before["weight"])

    @SIZES
    def test_disabled_empty_and_unpartitioned(self, world_size: int) -> None:
        model = nn.Linear(5, 3)
        plain = nn.Linear(2, 2)
        zpartition.partition(model, config=ZeroParamConfig(param_persistence_threshold=0))
        with GatheredParameters(model.weight, enabled=False):
            assert model.weight.numel() == 0
        with GatheredParameters([]), GatheredParameters(plain.parameters()):
            pass
        with GatheredParameters(model.weight, fwd_module=model):
            assert model.weight.ds_id in externals(model)
        with pytest.raises(TypeError, match="not a ZeRO-3 parameter"):
            zpartition._gather.gather_now([plain.weight])  # type: ignore[list-item]


class TestAllGatherPartition(DistributedTest):
    @SIZES
    def test_param_all_gather_and_partition(self, world_size: int) -> None:
        model = nn.Linear(4, 4)
        zpartition.Init(module=model)
        model.weight.all_gather()
        assert model.weight.ds_status is ZeroParamStatus.AVAILABLE
        assert model.weight.shape == (4, 4)
        summary = model.weight.ds_summary()
        assert summary["status"] == "AVAILABLE"
        assert summary["ds_numel"] == 16
        model.weight.partition()
        assert _status(model.weight) is ZeroParamStatus.NOT_AVAILABLE
        assert model.weight.numel() == 0
        copy.deepcopy(model)  # partitioned modules still copy


class TestUnhooked(DistributedTest):
    @SIZES
    def test_a_plain_model_inside_and_training_goes_on_after(self, world_size: int) -> None:
        """``Partitioned.unhooked()``: everything gathered and no hooks inside (generation's
        forward passes, token after token); released and hooked again after."""
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        # no prefetch: each module's own hook gathers its parameters
        config = ZeroParamConfig(param_persistence_threshold=0, prefetch_bucket_size=0)
        handle = zpartition.partition(model, config=config)
        data = batches(4, 2 * world_size)
        expected = reference_losses(reference, data[:2], lr=0.1)
        losses = train_partitioned(model, handle.shard_parameters(), data[:2], lr=0.1)
        up: Any = model.blocks[0].up
        seen: list[bool] = []  # a hook added after partitioning, which reads the weight
        weight = up.weight  # read outside a forward: reading it inside would gather it
        up.register_forward_pre_hook(
            lambda m, args: seen.append(weight.ds_status is ZeroParamStatus.AVAILABLE)
        )
        with handle.unhooked():
            assert all(not m._forward_hooks for m in model.modules())
            assert all(not m._forward_pre_hooks for m in model.modules() if m is not up)
            for p in model.parameters():
                assert _status(p) is ZeroParamStatus.AVAILABLE
                assert p.shape == p.ds_shape
            with torch.no_grad():
                for tokens in data[2:]:
                    torch.testing.assert_close(model(tokens), reference(tokens))
        assert all(_status(p) is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
        assert model._forward_pre_hooks
        assert model.blocks[0]._forward_pre_hooks
        expected += reference_losses(reference, data[2:], lr=0.1)
        losses += train_partitioned(model, handle.shard_parameters(), data[2:], lr=0.1)
        assert losses == pytest.approx(expected, rel=1e-5)
        assert len(seen) == 4
        assert all(seen)  # zpartition's hooks were put back ahead of it

    @pytest.mark.parametrize("world_size", [2])
    def test_the_two_halves_and_deepspeeds_external_parameters(self, world_size: int) -> None:
        """`unhook_forward` and `hook_forward`, for callers that pair them themselves (TRL's
        generation inside its own ``GatheredParameters``): each does nothing the second time;
        every module answers DeepSpeed's ``ds_external_parameters()``."""
        torch.manual_seed(0)
        model: Any = TinyGPT()  # its modules carry DeepSpeed's method, which mypy cannot see
        # Any: mypy would take the property for constant between the calls that change it
        handle: Any = zpartition.partition(
            model, config=ZeroParamConfig(param_persistence_threshold=0)
        )
        zpartition.register_external_parameter(model.blocks[0], model.embed.weight)
        assert model.blocks[0].ds_external_parameters() == [
            (model.embed.weight.ds_id, model.embed.weight)
        ]
        assert all(m.ds_external_parameters() == [] for m in model.blocks[1].modules())
        hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
        assert handle.forward_hooked
        for _ in range(2):
            handle.unhook_forward()
            assert not handle.forward_hooked
            assert not any(m._forward_pre_hooks for m in model.modules())
        for _ in range(2):
            handle.hook_forward()
            assert handle.forward_hooked
            assert sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks
        handle.remove()
        assert not any("ds_external_parameters" in m.__dict__ for m in model.modules())


class TestTakenFromTheBlock(DistributedTest):
    @SIZES
    def test_a_state_dict_taken_inside_stays_valid(self, world_size: int) -> None:
        """As with DeepSpeed, tensors taken from gathered parameters (``state_dict()`` holds
        views of them, and ``.cpu()`` on the host is no copy) keep their values after the
        block releases the parameters."""
        torch.manual_seed(0)
        model = TinyGPT()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        zpartition.partition(model, config=ZeroParamConfig(param_persistence_threshold=0))
        with GatheredParameters(list(model.parameters())):
            taken = model.state_dict()
            detached = [p.detach().cpu() for p in model.parameters()]
        assert all(_status(p) is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
        assert taken.keys() == expected.keys()
        for name, value in taken.items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
        assert [d.shape for d in detached] == [p.ds_shape for p in model.parameters()]
        weight: Any = model.embed.weight
        weight.all_gather()  # DeepSpeed's explicit pair: the same holds
        taken_weight = weight.data
        weight.partition()
        torch.testing.assert_close(taken_weight, expected["embed.weight"], rtol=0, atol=0)
        loss = model(batches(1, 2)[0])  # the next gather fills a buffer of its own
        loss.backward()
        for name, value in taken.items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


class Parent(nn.Module):
    """Initializes its children's weights at the end of its ``__init__`` (Hugging Face's
    ``post_init``), when they are already cut."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 5)
        self.second = nn.Sequential(nn.Linear(5, 4), nn.ReLU())
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.fill_(1.0 + zcomm.get_rank())  # ranks differ: rank 0's is kept
            assert module.bias is not None
            module.bias.data.zero_()


class TestInitApply(DistributedTest):
    @SIZES
    def test_apply_in_init_reaches_partitioned_children(self, world_size: int) -> None:
        with zpartition.Init():
            model = Parent()
        linears: list[nn.Linear] = [model.first, model.second[0]]  # type: ignore[list-item]
        for linear in linears:
            assert _status(linear.weight) is ZeroParamStatus.NOT_AVAILABLE
        with GatheredParameters(list(model.parameters())):
            for linear in linears:
                assert torch.equal(linear.weight, torch.ones_like(linear.weight))
                assert torch.equal(linear.bias, torch.zeros_like(linear.bias))
        assert nn.Module.apply.__name__ == "apply"  # put back on exit
        model.apply(lambda m: None)  # outside Init: the plain apply, nothing gathered
