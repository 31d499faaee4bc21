"""Writes into shards through ``ds_tensor`` (DeepSpeed's ``param.ds_tensor.data = t``), rebinding
``ds_tensor``, and modules built with ``torch.nn.utils.skip_init`` under Init."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import GatheredParameters, ZeroParamConfig, ZeroParamError

from ._helpers import reference_losses, train_partitioned

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
LR = 0.05
# a.bias (7), b.weight (21) and b.bias (3) stay gathered; a.weight (35) is gathered per module
SOME_PERSISTENT = ZeroParamConfig(param_persistence_threshold=21)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _build(build: str, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(0)
    if build == "init":
        with zpartition.Init(dtype=dtype):
            return Net()
    return Net().to(dtype)


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """A full fp32 value per parameter, distinct everywhere: what the ranks write between them."""
    return {
        name: torch.linspace(-1, 1, int(p.ds_numel)).reshape(p.ds_shape) * (i + 1)
        for i, (name, p) in enumerate(model.named_parameters())
    }


def _own_chunk(full: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of `full` flattened, ceil(numel / world) elements, the padding -7 (a
    value a gather must never show)."""
    rank, world = zcomm.get_rank(), zcomm.get_world_size()
    chunk = math.ceil(full.numel() / world)
    out = torch.full((chunk,), -7.0, dtype=full.dtype)
    mine = full.reshape(-1)[rank * chunk : (rank + 1) * chunk]
    out[: mine.numel()] = mine
    return out


def _write(model: nn.Module, targets: dict[str, torch.Tensor], how: str = "data") -> None:
    """Each rank writes its chunk of the targets into its shards, in fp32 (converted)."""
    for name, p in model.named_parameters():
        chunk = _own_chunk(targets[name])
        if how == "data":
            p.ds_tensor.data = chunk
        else:
            p.ds_tensor.copy_(chunk)


def _plain(targets: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    net = Net().to(dtype)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(targets[name])
    return net


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _data(dtype: torch.dtype, steps: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(8, 5, generator=g).to(dtype) for _ in range(steps)]


def _square_loss(model: nn.Module, world: int) -> Any:
    rank = zcomm.get_rank()
    return lambda item: model(item.chunk(world)[rank]).float().square().mean()


class TestDataWrites(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("build", ["init", "partition"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_written_values_are_gathered_computed_with_and_trained_from(
        self, world_size: int, build: str, dtype: torch.dtype
    ) -> None:
        model = _build(build, dtype)
        handle = zpartition.partition(model, config=SOME_PERSISTENT)
        assert {p.ds_persist for p in model.parameters()} == {True, False}
        loss_of = _square_loss(model, world_size)
        train_partitioned(model, handle.shard_parameters(), _data(dtype, 1), LR, loss_of)

        targets = _targets(model)  # written after a forward, a backward and a step
        _write(model, targets)
        for name, full in _gathered(model).items():
            assert full.dtype == dtype
            assert torch.equal(full, targets[name].to(dtype)), name
        reference = _plain(targets, dtype)
        x = torch.randn(4, 5).to(dtype)
        torch.testing.assert_close(model(x), reference(x))

        data = _data(dtype)
        losses = train_partitioned(model, handle.shard_parameters(), data, LR, loss_of)
        expected = reference_losses(
            reference, data, LR, lambda item: reference(item).float().square().mean()
        )
        # bf16: the ranks' gradients are averaged in bf16, the reference's are not
        fp32 = dtype == torch.float32
        torch.testing.assert_close(
            losses, expected, rtol=1e-5 if fp32 else 2e-2, atol=1e-6 if fp32 else 1e-3
        )

    @SIZES
    def test_copy_writes_in_place_writes_and_the_journal(self, world_size: int) -> None:
        model = _build("partition")
        handle = zpartition.partition(model, config=SOME_PERSISTENT)
        assert handle.take_written() == []
        targets = _targets(model)
        a, b = model.a, model.b
        a.weight.ds_tensor.data = _own_chunk(targets["a.weight"])
        b.bias.ds_tensor.copy_(_own_chunk(targets["b.bias"]).double())  # converted too
        b.bias.ds_tensor.copy_(torch.tensor(5.0))  # broadcast, as torch's copy_
        assert torch.equal(b.bias.ds_tensor, torch.full_like(b.bias.ds_tensor, 5.0))
        b.bias.ds_tensor.copy_(_own_chunk(targets["b.bias"]))  # named once
        with torch.no_grad():
            b.weight.ds_tensor.mul_(0).add_(_own_chunk(targets["b.weight"]))  # not journaled
        assert handle.take_written() == [a.weight, b.bias]  # in ds_id order
        assert handle.take_written() == []
        gathered = _gathered(model)
        for name in ("a.weight", "b.bias", "b.weight"):
            assert torch.equal(gathered[name], targets[name]), name

    @SIZES
    def test_writes_under_init_alone(self, world_size: int) -> None:
        model = _build("init")
        targets = _targets(model)
        _write(model, targets)
        for name, full in _gathered(model).items():
            assert torch.equal(full, targets[name]), name


class TestRefusedWrites(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_a_value_of_another_shape_raises_naming_the_supported_way(
        self, world_size: int
    ) -> None:
        model = _build("partition")
        zpartition.partition(model, config=SOME_PERSISTENT)
        shard: Any = model.a.weight.ds_tensor  # Any: `.data = 3.0` below
        before = shard.detach().clone()
        for value in (torch.zeros(shard.numel() + 1), torch.zeros(1, shard.numel()), 3.0):
            with pytest.raises(ZeroParamError, match=r"modifier_rank=0.*safe_set_full_fp32_param"):
                shard.data = value
        with pytest.raises(ZeroParamError, match=r"a\.weight.*shape \(1,\)"):
            shard.data = torch.zeros(1)
        with pytest.raises(RuntimeError, match=r"must match|expand"):  # torch's own: in place
            shard.copy_(torch.zeros(2, 3))
        assert torch.equal(shard, before)

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_a_rebound_ds_tensor_raises_at_the_next_pass(self, world_size: int) -> None:
        model = _build("partition")
        zpartition.partition(model, config=SOME_PERSISTENT)
        weight = model.a.weight
        shard = weight.ds_tensor
        weight.ds_tensor = shard.view(-1)  # the same memory: taken back, nothing lost
        model(torch.randn(2, 5))
        assert weight.ds_tensor is shard
        weight.ds_tensor = torch.zeros_like(shard)
        with pytest.raises(ZeroParamError, match=r"a\.weight.*replaced.*ds_tensor\.data = t"):
            model(torch.randn(2, 5))
        with pytest.raises(ZeroParamError, match="replaced"):
            GatheredParameters([weight]).__enter__()
        weight.ds_tensor = shard  # put back: the model runs again
        model(torch.randn(2, 5)).sum().backward()

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_rebinding_before_partition_is_what_the_units_are_built_from(
        self, world_size: int
    ) -> None:
        model = _build("init")
        targets = _targets(model)
        held = model.a.weight.ds_tensor  # the Init unit's shard
        for name, p in model.named_parameters():
            p.ds_tensor = _own_chunk(targets[name])  # as an engine casts or moves shards
        zpartition.partition(model, config=SOME_PERSISTENT)
        for name, full in _gathered(model).items():
            assert torch.equal(full, targets[name]), name
        with pytest.raises(ZeroParamError, match="no longer uses"):
            held.data = torch.zeros_like(held)

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_a_model_partitioned_again_runs_and_its_old_shards_refuse_writes(
        self, world_size: int
    ) -> None:
        """A second ``partition`` (a second ``zengine.initialize`` of one model) builds new
        units: the first one's hooks find every ``ds_tensor`` changed, which is no rebinding."""
        model = _build("partition")
        zpartition.partition(model, config=SOME_PERSISTENT)
        old = model.a.weight.ds_tensor
        zpartition.partition(model, config=SOME_PERSISTENT)
        model(torch.randn(2, 5)).sum().backward()
        with pytest.raises(ZeroParamError, match="no longer uses"):
            old.data = torch.zeros_like(old)
        targets = _targets(model)
        _write(model, targets)
        for name, full in _gathered(model).items():
            assert torch.equal(full, targets[name]), name


class _Copies(TorchDispatchMode):
    """Counts the copies torch runs (single and foreach)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.name().startswith(("aten::copy_", "aten::_foreach_copy")):
            self.count += 1 if func.name().startswith("aten::copy_") else len(args[0])
        return func(*args, **(kwargs or {}))


def _step_costs(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, tuple[int, int]], int]:
    """One forward and backward: (count, bytes) of each collective, and the copies made."""
    zcomm.reset_comm_accounting()
    zcomm.enable_comm_accounting()
    copies = _Copies()
    try:
        with copies:
            model(x).sum().backward()
        stats = {op: (s.count, s.bytes) for op, s in zcomm.comm_summary().items()}
    finally:  # the pool's worker runs other tests next
        zcomm.enable_comm_accounting(False)
        zcomm.reset_comm_accounting()
    return stats, copies.count


class TestCost(DistributedTest):
    @SIZES
    def test_nothing_written_costs_nothing_and_a_write_only_its_gather(
        self, world_size: int
    ) -> None:
        model = _build("partition")
        zpartition.partition(model, config=SOME_PERSISTENT)
        x = torch.randn(4, 5)
        for _ in range(2):  # the traces are recorded
            _step_costs(model, x)
        steady = _step_costs(model, x)
        assert _step_costs(model, x) == steady
        targets = _targets(model)
        a, b = model.a, model.b
        a.weight.ds_tensor.data = _own_chunk(targets["a.weight"])  # gathered per module anyway
        assert _step_costs(model, x) == steady
        b.weight.ds_tensor.data = _own_chunk(targets["b.weight"])  # a persistent one
        written = _step_costs(model, x)
        if world_size > 1:  # the persistent unit is gathered once more, then never again
            gathers = "all_gather_into_tensor"
            (count, nbytes), (count0, nbytes0) = written[0][gathers], steady[0][gathers]
            assert count > count0
            assert nbytes > nbytes0
        else:
            assert written == steady  # one rank: the shard is the data
        assert _step_costs(model, x) == steady
        assert torch.equal(_gathered(model)["b.weight"], targets["b.weight"])


class _MemoryStore:
    """A `ShardStore` that keeps released shards in a dict and empties their storage."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}

    def fetch(self, shards: Sequence[torch.Tensor]) -> None:
        for shard in shards:
            saved = self.kept.pop(id(shard), None)
            if saved is not None:
                shard.untyped_storage().resize_(saved.numel())
                shard.copy_(saved)

    def evict(self, shard: torch.Tensor) -> None:
        if id(shard) not in self.kept:
            self.kept[id(shard)] = shard.clone()
            shard.untyped_storage().resize_(0)


class TestStoredShards(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_a_write_to_a_stored_shard_is_kept_by_the_store(self, world_size: int) -> None:
        model = _build("partition")
        handle = zpartition.partition(model, config=ZeroParamConfig(param_persistence_threshold=0))
        store = _MemoryStore()
        handle.set_shard_store(store)
        weight = model.a.weight
        assert weight.ds_tensor.untyped_storage().nbytes() == 0  # away
        targets = _targets(model)
        weight.ds_tensor.data = _own_chunk(targets["a.weight"])
        assert weight.ds_tensor.untyped_storage().nbytes() == 0  # away again, with the write
        assert torch.equal(_gathered(model)["a.weight"], targets["a.weight"])

    @pytest.mark.parametrize("world_size", [1])
    def test_a_write_to_an_emptied_shard_raises(self, world_size: int) -> None:
        model = _build("partition")
        zpartition.partition(model, config=ZeroParamConfig(param_persistence_threshold=0))
        shard = model.a.weight.ds_tensor
        shard.untyped_storage().resize_(0)  # as offload_states leaves it
        with pytest.raises(ZeroParamError, match="offloaded"):
            shard.data = torch.zeros_like(shard)


class SubModel(nn.Module):
    """DeepSpeed's TestParamPartitioningSkipInit's: children built with the device it is given."""

    def __init__(self, size: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(size, size, device=device)
        self.dropout = nn.Dropout(0.0)
        self.module_list = nn.ModuleList([nn.Linear(size, size, device=device)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module_list[0](self.dropout(self.linear(x)))


class SkipInitModel(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.l1 = nn.utils.skip_init(nn.Linear, size, size)
        self.l2 = nn.utils.skip_init(SubModel, size)
        self.l3 = nn.Linear(size, size)
        self.l4 = nn.utils.skip_init(SubModel, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l4(torch.tanh(self.l3(self.l2(self.l1(x)))))


def _linears(model: nn.Module) -> Iterator[nn.Linear]:
    return (m for m in model.modules() if isinstance(m, nn.Linear))


class TestSkipInit(DistributedTest):
    @SIZES
    def test_modules_built_by_skip_init_are_partitioned_and_train(self, world_size: int) -> None:
        torch.manual_seed(0)
        reference = SkipInitModel(10)
        for p in reference.parameters():  # skip_init leaves them unset: give them values
            with torch.no_grad():
                p.normal_(0, 0.3)
        with zpartition.Init():
            model = SkipInitModel(10)
        for linear in _linears(model):
            assert linear.weight.ds_tensor.numel() == math.ceil(100 / world_size)
            assert linear.bias.ds_tensor.numel() == math.ceil(10 / world_size)
            assert linear.weight.numel() == 0
        assert "to_empty" not in model.l2.__dict__  # the hook goes once it ran
        params = dict(model.named_parameters())
        for name, p in reference.named_parameters():
            with GatheredParameters([params[name]], modifier_rank=0):
                params[name].data.copy_(p.data)
        handle = zpartition.partition(model, config=ZeroParamConfig(param_persistence_threshold=0))
        g = torch.Generator().manual_seed(5)
        data = [torch.randn(8, 10, generator=g) for _ in range(3)]
        losses = train_partitioned(
            model, handle.shard_parameters(), data, LR, _square_loss(model, world_size)
        )
        expected = reference_losses(
            reference, data, LR, lambda item: reference(item).square().mean()
        )
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
