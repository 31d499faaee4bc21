"""partition(): parity with an unpartitioned model, storage, statuses, the coordinator, errors."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import ZeroParamConfig, ZeroParamError, ZeroParamStatus

from ._helpers import Block, TinyGPT, batches, reference_losses, train_partitioned

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
LR = 0.1
CONFIGS = {
    # every parameter partitioned: TinyGPT's blocks are one unit each (module groups)
    "threshold-0": ZeroParamConfig(param_persistence_threshold=0),
    "unit-per-module": ZeroParamConfig(param_persistence_threshold=0, module_group_size=0),
    "no-reuse": ZeroParamConfig(param_persistence_threshold=0, max_reuse_distance=0),
    "small-prefetch": ZeroParamConfig(
        param_persistence_threshold=0, prefetch_bucket_size=600, max_live_parameters=2000
    ),
    "persistent": ZeroParamConfig(),
    "some-persistent": ZeroParamConfig(param_persistence_threshold=48),
    "small-buckets-sync": ZeroParamConfig(
        param_persistence_threshold=0, reduce_bucket_size=700, overlap_comm=False
    ),
    "small-buckets-overlap": ZeroParamConfig(param_persistence_threshold=0, reduce_bucket_size=700),
    "kept-buckets": ZeroParamConfig(param_persistence_threshold=0, persistent_grad_buckets=True),
    "kept-small-buckets": ZeroParamConfig(
        param_persistence_threshold=0, reduce_bucket_size=700, persistent_grad_buckets=True
    ),
    "granularity": ZeroParamConfig(
        param_persistence_threshold=0, module_granularity_threshold=10**6
    ),
}


def _train(
    model: nn.Module,
    handle: zpartition.Partitioned,
    data: list[Any],
    loss_of: Callable[[Any], torch.Tensor] | None = None,
) -> list[float]:
    return train_partitioned(model, handle.shard_parameters(), data, LR, loss_of)


def _mine(tokens: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a global batch."""
    return tokens.chunk(zcomm.get_world_size())[zcomm.get_rank()]


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with zpartition.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


class _Checkpointed(TinyGPT):
    """TinyGPT whose blocks keep no activations: torch's checkpoint, reentrant, non-reentrant
    (stopping its recomputation early, torch's default), or non-reentrant run whole."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            if self.mode == "reentrant":
                x = checkpoint(block, x, use_reentrant=True)
            else:
                with set_checkpoint_early_stop(self.mode == "early-stop"):
                    x = checkpoint(block, x, use_reentrant=False)
        logits = self.norm(x) @ self.embed.weight.t() + self.bias
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())


class TestParity(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("name", list(CONFIGS))
    def test_losses_and_weights_match_unpartitioned(self, world_size: int, name: str) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        data = batches(4, 8)
        handle = zpartition.partition(model, config=CONFIGS[name])
        losses = _train(model, handle, data)
        expected = reference_losses(reference, data, LR)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
        for n, value in _full(model).items():
            torch.testing.assert_close(value, reference.get_parameter(n), rtol=1e-5, atol=1e-6)

    @SIZES
    @pytest.mark.parametrize("mode", ["reentrant", "early-stop", "whole"])
    @pytest.mark.parametrize("name", ["threshold-0", "unit-per-module"])
    def test_checkpointed_blocks_match_unpartitioned(
        self, world_size: int, mode: str, name: str
    ) -> None:
        # The blocks' forward runs again in backward. Non-reentrant, it runs after the block's
        # last module began its backward: "whole" (torch's early stop off) runs that module's
        # forward hook too, which must not release what its backward is about to read.
        torch.manual_seed(0)
        model = _Checkpointed(mode)
        reference = copy.deepcopy(model)
        data = batches(3, 8)
        handle = zpartition.partition(model, config=CONFIGS[name])
        losses = _train(model, handle, data)
        expected = reference_losses(reference, data, LR)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("world_size", [2])
    def test_a_compiled_model_matches_unpartitioned(self, world_size: int) -> None:
        # the hooks run eagerly between the compiled graphs (they move the parameters' storage)
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        data = batches(3, 8)
        handle = zpartition.partition(model, config=CONFIGS["threshold-0"])
        compiled = cast("nn.Module", torch.compile(model))
        losses = train_partitioned(compiled, handle.shard_parameters(), data, LR)
        expected = reference_losses(reference, data, LR)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_kept_bucket_is_one_buffer_across_passes(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        config = ZeroParamConfig(param_persistence_threshold=0, persistent_grad_buckets=True)
        handle = zpartition.partition(model, config=config)
        assert handle.grad_buffers == []  # made by the first backward
        data = batches(3, 4)
        _train(model, handle, data[:1])
        (buffer,) = handle.grad_buffers
        # freed in between (as offload_states does), it is given memory again and reused
        buffer.untyped_storage().resize_(0)
        _train(model, handle, data[1:])
        assert handle.grad_buffers == [buffer]
        assert buffer.untyped_storage().nbytes() > 0
        plain = zpartition.partition(TinyGPT(), config=CONFIGS["threshold-0"])
        _train(plain.module, plain, data[:1])
        assert plain.grad_buffers == []  # without the option, buckets live while reduced

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_overlapped_buckets_are_finished_as_the_next_is_launched(self, world_size: int) -> None:
        # small buckets, overlap on: a backward keeps at most one reduction in flight after each
        # launch (it kept every bucket of the pass until its end)
        torch.manual_seed(0)
        model = TinyGPT()
        handle = zpartition.partition(model, config=CONFIGS["small-buckets-overlap"])
        in_flight: list[int] = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(
                lambda _: in_flight.append(len(handle._state.reducing))
            )
        _train(model, handle, batches(1, 4))
        if world_size == 1:
            assert in_flight == [0] * len(in_flight)  # one rank keeps its gradients
        else:
            assert max(in_flight) == 1  # one at a time
            assert in_flight.count(1) > 1  # of several buckets

    @SIZES
    def test_leaf_blocks_match(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        zpartition.set_z3_leaf_modules(model, [Block])
        handle = zpartition.partition(model, config=CONFIGS["threshold-0"])
        assert {u.name for u in handle.units} == {
            "<root>",
            "embed",
            "blocks.0",
            "blocks.1",
            "blocks.2",
            "norm",
        }
        data = batches(3, 4)
        torch.testing.assert_close(
            _train(model, handle, data), reference_losses(reference, data, LR), rtol=1e-5, atol=1e-6
        )

    @SIZES
    def test_fused_optimizer_updates_persistent_parameters(self, world_size: int) -> None:
        """torch's fused kernels write the shards without moving their version counter; the
        persistent ones must be gathered again after the step all the same."""
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        data = batches(3, 8)
        handle = zpartition.partition(model, config=ZeroParamConfig())  # small ones persist
        assert any(u.persistent for u in handle.units)
        rank, world = zcomm.get_rank(), zcomm.get_world_size()
        ours = torch.optim.AdamW(handle.shard_parameters(), lr=1e-2, fused=True)
        theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
        for tokens in data:
            loss = model(tokens.chunk(world)[rank])
            loss.backward()
            ours.step()
            ours.zero_grad()
            reference(tokens).backward()
            theirs.step()
            theirs.zero_grad()
        for n, value in _full(model).items():
            torch.testing.assert_close(value, reference.get_parameter(n), rtol=1e-5, atol=1e-6)

    @SIZES
    def test_gradient_accumulation(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        handle = zpartition.partition(model, config=CONFIGS["threshold-0"])
        shards = handle.shard_parameters()
        rank = zcomm.get_rank()
        for tokens in batches(2, 4 * world_size):
            model(tokens.chunk(world_size)[rank]).backward()
            reference(tokens).backward()
        full = {p.ds_id: p for p in model.parameters()}
        for (n, ref), p in zip(reference.named_parameters(), full.values(), strict=True):
            chunk = p.ds_tensor.numel()
            flat = torch.nn.functional.pad(
                ref.grad.reshape(-1), (0, chunk * world_size - ref.numel())
            )
            torch.testing.assert_close(
                p.ds_tensor.grad, flat[rank * chunk : (rank + 1) * chunk], msg=n
            )
        assert all(s.grad is not None for s in shards)


class TestGradientSink(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("name", ["threshold-0", "some-persistent", "small-prefetch"])
    def test_sink_receives_the_averaged_shard_gradients(self, world_size: int, name: str) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        received: dict[int, torch.Tensor] = {}

        def sink(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]) -> None:
            for p, g in zip(params, grads, strict=True):
                assert g.shape == p.ds_tensor.shape
                received[p.ds_id] = received.get(p.ds_id, torch.zeros_like(g)) + g

        zpartition.partition(model, config=CONFIGS[name], gradient_sink=sink)
        rank = zcomm.get_rank()
        for tokens in batches(2, 4 * world_size):
            model(tokens.chunk(world_size)[rank]).backward()
            reference(tokens).backward()
        for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.ds_tensor.grad is None  # the sink took them
            chunk = p.ds_tensor.numel()
            flat = nn.functional.pad(ref.grad.reshape(-1), (0, chunk * world_size - ref.numel()))
            torch.testing.assert_close(received[p.ds_id], flat[rank * chunk : (rank + 1) * chunk])


def _collect(into: list[torch.Tensor]) -> Any:
    """A gradient sink that keeps what it is given."""
    return lambda _, grads: into.extend(g.clone() for g in grads)


class TestReduceDtype(DistributedTest):
    world_size = 2

    def test_bf16_gradients_are_summed_in_the_reduce_dtype(self) -> None:
        # rank 0's gradient is 1, rank 1's 2**-9: summed in bf16 that rounds to 1 (8
        # significant bits); in float32 it does not. The sink gets the float32 average; without
        # a sink the shard's .grad comes back in the parameter's dtype.
        x = torch.tensor([[1.0 if zcomm.get_rank() == 0 else 2.0**-9]], dtype=torch.bfloat16)
        for reduce_dtype, expected in [(None, 0.5), (torch.float32, (1 + 2.0**-9) / 2)]:
            received: list[torch.Tensor] = []
            model = nn.Linear(1, 1, bias=False).bfloat16()
            config = ZeroParamConfig(param_persistence_threshold=0, reduce_dtype=reduce_dtype)
            zpartition.partition(model, config=config, gradient_sink=_collect(received))
            model(x).float().sum().backward()
            values = [g[0].item() for g in received if g.numel()]
            assert values == [expected] if zcomm.get_rank() == 0 else values in ([], [0.0])
            assert all(g.dtype == (reduce_dtype or torch.bfloat16) for g in received)
        plain = nn.Linear(1, 1, bias=False).bfloat16()
        config = ZeroParamConfig(param_persistence_threshold=0, reduce_dtype=torch.float32)
        zpartition.partition(plain, config=config)
        plain(x).float().sum().backward()
        assert plain.weight.ds_tensor.grad.dtype == torch.bfloat16

    @pytest.mark.parametrize("world_size", [2, 4])
    def test_a_comm_dtype_attribute_overrides_the_reduce_dtype(self, world_size: int) -> None:
        # fp32 parameters: the one marked comm_dtype=bf16 (autocast's lower-precision safe)
        # is reduced in bf16, the other in the config's float32, in one backward and bucket
        x = torch.tensor([[1.0 if zcomm.get_rank() == 0 else 2.0**-9]])
        model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False))
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1.0)
        model[0].weight.comm_dtype = torch.bfloat16
        received: list[torch.Tensor] = []
        config = ZeroParamConfig(param_persistence_threshold=0, reduce_dtype=torch.float32)
        zpartition.partition(model, config=config, gradient_sink=_collect(received))
        model(x).sum().backward()
        by_dtype = {g.dtype: g[0].item() for g in received if g.numel()}
        if zcomm.get_rank() == 0:  # the gradients of both are x
            exact = (1 + (world_size - 1) * 2.0**-9) / world_size
            assert by_dtype[torch.float32] == exact
            assert by_dtype[torch.bfloat16] != exact  # 1 + 2**-9 rounded
        assert set(by_dtype) <= {torch.float32, torch.bfloat16}

    @pytest.mark.parametrize("world_size", [1])
    def test_a_reduce_dtype_must_be_a_floating_dtype(self, world_size: int) -> None:
        with pytest.raises(TypeError, match=r"reduce_dtype must be a floating torch\.dtype"):
            ZeroParamConfig(reduce_dtype=torch.int32)
        with pytest.raises(TypeError, match=r"reduce_dtype must be a floating torch\.dtype"):
            ZeroParamConfig(reduce_dtype="fp32")  # type: ignore[arg-type]


class TestNarrowGather(DistributedTest):
    @pytest.mark.parametrize("world_size", [2, 4])
    def test_a_pass_gathers_in_the_comm_dtype_and_other_readers_exactly(
        self, world_size: int
    ) -> None:
        # fp32 Linears, the first marked comm_dtype=bf16 (what zengine's torch_autocast does):
        # its forward and backward read bf16-rounded weights (what autocast computes with),
        # gathered in half the bytes; GatheredParameters reads the exact fp32 values, also
        # of a unit a pass holds gathered narrow at that moment
        def linears(marked: bool) -> tuple[nn.Linear, nn.Linear]:
            torch.manual_seed(0)
            first, second = nn.Linear(64, 64), nn.Linear(64, 64)
            if marked:
                for p in first.parameters():
                    p.comm_dtype = torch.bfloat16
            return first, second

        exact, _ = linears(False)
        first, second = linears(True)
        model = nn.Sequential(first, second)
        seen: dict[str, torch.Tensor] = {}

        def look(module: nn.Module, args: Any, output: Any) -> None:
            seen["pass"] = first.weight.detach().clone()
            if "gathered" not in seen:  # the second pass: read exactly while the pass runs
                with zpartition.GatheredParameters([first.weight]):
                    seen["gathered"] = first.weight.detach().clone()

        zpartition.partition(model, config=ZeroParamConfig(param_persistence_threshold=0))
        first.register_forward_hook(look)
        x = torch.randn(2, 64)
        seen["gathered"] = torch.empty(0)  # the first pass: no exact read inside it
        model(x).sum().backward()
        assert torch.equal(seen["pass"], exact.weight.bfloat16().float())
        assert not torch.equal(seen["pass"], exact.weight)
        # what goes on the wire: half the shard's bytes
        marked, plain = first.weight.ds_unit, second.weight.ds_unit
        assert marked.wire_bytes * 2 == marked.shard.numel()
        assert plain.wire_bytes is None
        del seen["gathered"]
        model(x).sum().backward()
        assert torch.equal(seen["gathered"], exact.weight)
        with zpartition.GatheredParameters(list(first.parameters())):
            assert torch.equal(first.weight, exact.weight)
            assert torch.equal(first.bias, exact.bias)


class TestRemove(DistributedTest):
    @SIZES
    def test_remove_gives_back_a_plain_model(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        handle = zpartition.partition(model, config=CONFIGS["some-persistent"])
        data = batches(3, 8)
        _train(model, handle, data[:2])
        handle.remove()
        reference_losses(reference, data[:2], LR)
        for (n, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert not zpartition.is_zero_param(p), n
            torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6)
        assert not any(type(m._parameters) is not dict for m in model.modules())
        losses = reference_losses(model, data[2:], LR)  # trains as a plain model, no hooks
        assert losses == pytest.approx(reference_losses(reference, data[2:], LR), rel=1e-5)


class TestStorageAndStatus(DistributedTest):
    @SIZES
    def test_each_rank_keeps_ceil_numel_over_world(self, world_size: int) -> None:
        model = TinyGPT()
        shapes = {n: p.shape for n, p in model.named_parameters()}
        zpartition.partition(model, config=CONFIGS["threshold-0"])
        for n, p in model.named_parameters():
            assert p.ds_tensor.shape == (math.ceil(shapes[n].numel() / world_size),)
            assert p.ds_shape == shapes[n]
            assert p.ds_numel == shapes[n].numel()
            assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
            assert p.numel() == 0
            assert zpartition.is_zero_param(p)
            assert not p.ds_persist

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_host_shards_asked_pinned_train_alike_without_cuda(self, world_size: int) -> None:
        # pin_memory is for a CUDA machine; elsewhere the host shards are plain memory
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        cpu = torch.device("cpu")
        handle = zpartition.partition(
            model, config=CONFIGS["threshold-0"], shard_device=cpu, pin_memory=True
        )
        pinned = torch.cuda.is_available()
        assert all(p.ds_tensor.is_pinned() == pinned for p in model.parameters())
        data = batches(2, 4)
        torch.testing.assert_close(
            _train(model, handle, data), reference_losses(reference, data, LR), rtol=1e-5, atol=0
        )

    @SIZES
    def test_statuses_around_forward_and_backward(self, world_size: int) -> None:
        model = TinyGPT()
        zpartition.partition(
            model, config=ZeroParamConfig(param_persistence_threshold=48, max_reuse_distance=0)
        )
        seen: list[str] = []

        def check(module: nn.Module, args: object) -> None:
            for p in module.parameters(recurse=False):
                if p.ds_status is not ZeroParamStatus.AVAILABLE or p.shape != p.ds_shape:
                    seen.append(f"{type(module).__name__}: {p.ds_summary()}")

        for m in model.modules():
            m.register_forward_pre_hook(check)
        for _ in range(2):
            loss = model(batches(1, 2)[0])
            self._expect_released(model)
            loss.backward()
            self._expect_released(model)
        assert not seen

    @pytest.mark.parametrize("world_size", [2])
    def test_no_reuse_and_no_prefetch_release_each_module_after_its_forward(
        self, world_size: int
    ) -> None:
        """DeepSpeed's ``stage3_max_reuse_distance: 0`` keeps nothing for a later use, and a
        prefetch bucket of 0 fetches nothing ahead (so neither keeps a unit for being near)."""
        model = TinyGPT()
        config = ZeroParamConfig(
            param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=0
        )
        handle = zpartition.partition(model, config=config)
        kept: list[str] = []

        def check(module: nn.Module, args: object, output: object) -> None:
            for p in module.parameters(recurse=False):  # held by no module, still gathered
                if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE and not p.ds_active_sub_modules:
                    kept.append(f"{type(module).__name__}: {p.ds_summary()}")

        for m in model.modules():
            m.register_forward_hook(check)
        for _ in range(3):  # the first pass records the order, the next ones follow it
            model(batches(1, 2)[0]).backward()
        assert handle.coordinator.invalidations == 0
        assert not kept, kept

    @pytest.mark.parametrize("world_size", [2])
    def test_a_root_without_parameters_prefetches_its_children(self, world_size: int) -> None:
        """A root with no parameters of its own begins the pass with the plan's first gathers
        in flight, as DeepSpeed's: its first child finds them gathered or on the way."""
        model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5))
        # read here: read during a forward, it would be gathered for the module running
        first = cast(nn.Linear, model[0]).weight
        config = ZeroParamConfig(param_persistence_threshold=0, max_reuse_distance=0)
        zpartition.partition(model, config=config)
        seen: list[ZeroParamStatus] = []

        def before_its_own_hook(module: nn.Module, args: object) -> None:
            seen.append(first.ds_status)

        model[0].register_forward_pre_hook(before_its_own_hook, prepend=True)
        for _ in range(2):  # the first pass records the order, the second follows it
            model(torch.randn(2, 5)).sum().backward()
        assert seen[0] is ZeroParamStatus.NOT_AVAILABLE, seen  # no plan yet
        assert seen[1] in (ZeroParamStatus.INFLIGHT, ZeroParamStatus.AVAILABLE)

    @staticmethod
    def _expect_released(model: nn.Module) -> None:
        for p in model.parameters():
            if p.ds_persist:
                assert p.ds_status is ZeroParamStatus.AVAILABLE
                assert p.shape == p.ds_shape
            else:
                assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
                assert p.numel() == 0, p.ds_summary()
                assert not p.ds_active_sub_modules

    @SIZES
    def test_persistence_bounded_by_model_threshold(self, world_size: int) -> None:
        model = TinyGPT()
        zpartition.partition(
            model,
            config=ZeroParamConfig(
                param_persistence_threshold=10**6, model_persistence_threshold=600
            ),
        )
        persistent = [p for p in model.parameters() if p.ds_persist]
        assert 0 < sum(p.ds_numel for p in persistent) <= 600
        assert all(p.ds_status is ZeroParamStatus.AVAILABLE for p in persistent)


class TestCoordinator(DistributedTest):
    @SIZES
    def test_live_parameters_never_exceed_the_limit(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT(blocks=4)
        largest = max(p.numel() for p in model.parameters()) + 3 * 16
        limit = 2 * largest
        config = ZeroParamConfig(
            param_persistence_threshold=0, max_live_parameters=limit, prefetch_bucket_size=limit
        )
        handle = zpartition.partition(model, config=config)
        _train(model, handle, batches(3, 4))
        assert handle.peak_live_numel <= limit
        assert handle.peak_live_numel >= largest - 3 * 16

    @pytest.mark.parametrize("world_size", [2, 4])
    def test_a_large_prefetch_goes_as_several_gathers(self, world_size: int) -> None:
        """A prefetch bucket over the coalescing limit is gathered in pieces of at most the
        limit (a unit larger than it alone), and training is unchanged."""
        from zpartition import _unit

        limit = 1024  # bytes gathered: a linear layer of TinyGPT holds more, a norm less
        gathered: list[int] = []
        all_gather = zcomm.all_gather_into_tensor

        def recording(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            gathered.append(output.numel() * output.element_size())
            return all_gather(output, *args, **kwargs)

        saved = _unit._COALESCE_BYTES
        _unit._COALESCE_BYTES = limit
        _unit.zcomm.all_gather_into_tensor = recording  # the real collective, its sizes noted
        try:
            torch.manual_seed(0)
            model = TinyGPT()
            reference = copy.deepcopy(model)
            data = batches(3, 4)
            handle = zpartition.partition(model, config=CONFIGS["threshold-0"])
            losses = _train(model, handle, data)
        finally:
            _unit._COALESCE_BYTES = saved
            _unit.zcomm.all_gather_into_tensor = all_gather
        expected = reference_losses(reference, data, LR)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
        alone = {world_size * u.shard.numel() for u in handle.units}
        assert max(alone) > limit  # units over the limit
        assert min(alone) < limit  # and under it
        assert any(n > limit for n in gathered)  # a large unit, alone
        assert all(n <= limit or n in alone for n in gathered)  # never several over the limit

    @pytest.mark.parametrize("world_size", [2])
    def test_prefetch_follows_the_trace_and_eval_keeps_it(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        handle = zpartition.partition(model, config=CONFIGS["threshold-0"])
        _train(model, handle, batches(2, 4))
        model.eval()
        with torch.no_grad():
            model(batches(1, 2)[0])
        model.train()
        _train(model, handle, batches(2, 4))
        assert handle.coordinator.invalidations == 0
        assert len(handle.coordinator._traces) == 2

    @SIZES
    def test_a_model_run_twice_before_one_backward_keeps_its_plan(self, world_size: int) -> None:
        """Siamese steps (a policy run on chosen, then rejected): each forward is a pass of
        a kind of its own, the second one's trace holding the backward of both, so no step
        drops its plan (every one did, its backward running without prefetch)."""
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        handle = zpartition.partition(model, config=CONFIGS["threshold-0"])
        pairs = list(zip(batches(4, 4), batches(4, 4, seed=2), strict=True))
        losses = _train(
            model, handle, pairs, lambda p: (model(_mine(p[0])) + model(_mine(p[1]))) / 2
        )
        expected = reference_losses(
            reference, pairs, LR, lambda p: (reference(p[0]) + reference(p[1])) / 2
        )
        assert losses == pytest.approx(expected, rel=1e-5)
        assert handle.coordinator.invalidations == 0
        if world_size > 1:  # one rank keeps no trace: gathers cost nothing to wait for
            kinds = sorted(handle.coordinator._traces, key=str)
            assert kinds == [(True, True, 0), (True, True, 1)]

    @SIZES
    def test_a_forward_without_grad_before_the_backward_keeps_the_plan(
        self, world_size: int
    ) -> None:
        """Reference log-probabilities of the same model between a forward and its backward:
        the pass without grad records the backward after it, the same at every step, so no
        plan is dropped (a guard on the traces per kind)."""
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        handle = zpartition.partition(model, config=CONFIGS["threshold-0"])

        def with_reference(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            loss: torch.Tensor = model(_mine(pair[0]))
            with torch.no_grad():
                model(_mine(pair[1]))
            return loss

        data = batches(4, 4)
        losses = _train(
            model, handle, list(zip(data, batches(4, 4, seed=2), strict=True)), with_reference
        )
        expected = reference_losses(reference, data, LR)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
        assert handle.coordinator.invalidations == 0
        if world_size > 1:  # one rank keeps no trace: gathers cost nothing to wait for
            kinds = sorted(handle.coordinator._traces, key=str)
            assert kinds == [(True, False, 0), (True, True, 0)]

    @SIZES
    def test_a_new_order_warns_once_and_keeps_working(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        handle = zpartition.partition(model, config=CONFIGS["threshold-0"])
        data = batches(4, 4)
        losses = []
        for i, tokens in enumerate(data):
            blocks = model.blocks
            model.blocks = nn.ModuleList(reversed(blocks)) if i == 2 else blocks
            losses.append(_train(model, handle, [tokens])[0])
            model.blocks = blocks
            ref_blocks = reference.blocks
            reference.blocks = nn.ModuleList(reversed(ref_blocks)) if i == 2 else ref_blocks
            expected = reference_losses(reference, [tokens], LR)[0]
            reference.blocks = ref_blocks
            assert losses[-1] == pytest.approx(expected, rel=1e-5)
        if world_size > 1:  # one rank keeps no trace: gathers cost nothing to wait for
            assert handle.coordinator.invalidations >= 1
            assert handle.coordinator._warned


class _WithEmpty(nn.Module):
    """TinyGPT and a trainable parameter of no elements (a LoRA rank of 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT()
        self.extra = nn.Parameter(torch.zeros(0, 4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.gpt(tokens) + self.extra.sum()
        return loss


class TestParametersWithoutElements(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("under_init", [False, True])
    def test_left_whole_and_trained_around(self, world_size: int, under_init: bool) -> None:
        """As DeepSpeed: nothing to cut, gather or reduce, so no ds_id; the backward of
        several ranks divided by the parameter's chunk of 0 elements."""
        torch.manual_seed(0)
        reference = _WithEmpty()
        torch.manual_seed(0)
        if under_init:
            with zpartition.Init():
                model = _WithEmpty()
        else:
            model = _WithEmpty()
        handle = zpartition.partition(model, config=CONFIGS["threshold-0"])
        assert not hasattr(model.extra, "ds_id")
        assert all(hasattr(p, "ds_id") for p in model.gpt.parameters())
        data = batches(2, 4)
        losses = train_partitioned(model, handle.shard_parameters(), data, LR)
        expected = reference_losses(reference, data, LR)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        return self.b(x if skip else self.a(x))


class Stash(nn.Module):
    """Uses a child's weight through a plain list, which no hook can see."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stash = [self.lin.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.stash[0].t()


class TestErrors(DistributedTest):
    @pytest.mark.parametrize("world_size", [2, 4])
    def test_ranks_running_different_modules_raise_on_every_rank(self, world_size: int) -> None:
        model = Branchy()
        zpartition.partition(model, config=CONFIGS["threshold-0"])
        rank = zcomm.get_rank()
        model(torch.ones(2, 4), skip=False).sum().backward()  # all ranks alike: fine
        with pytest.raises(ZeroParamError) as caught:
            model(torch.ones(2, 4), skip=rank == 1).sum().backward()
        message = str(caught.value)
        assert "rank 1" in message
        assert "module 'a'" in message
        assert "module 'b'" in message
        assert "'a.weight'" in message

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_parameter_used_while_unavailable_is_named(self, world_size: int) -> None:
        model = Stash()
        zpartition.partition(model, config=CONFIGS["threshold-0"])
        with pytest.raises(
            ZeroParamError, match=r"rank \d: module '<root>'.*'lin.weight'.*not available"
        ):
            model(torch.ones(2, 4))

    @pytest.mark.parametrize("world_size", [1])
    def test_bad_arguments(self, world_size: int) -> None:
        with pytest.raises(TypeError, match=r"nn\.Module"):
            zpartition.partition("model")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_live_parameters must be >= 0"):
            ZeroParamConfig(max_live_parameters=-1)
        with pytest.raises(TypeError, match="prefetch_bucket_size must be an integer"):
            ZeroParamConfig(prefetch_bucket_size="big")  # type: ignore[arg-type]
        from_json = ZeroParamConfig(param_persistence_threshold=1e5)  # type: ignore[arg-type]
        assert from_json.param_persistence_threshold == 100_000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestPinnedShards(DistributedTest):
    world_size = 1

    def test_host_shards_of_a_cuda_model_are_pinned(self) -> None:
        # offload_param's shards: pinned, so each gather's copy to the GPU is asynchronous
        torch.manual_seed(0)
        model = TinyGPT().cuda()
        handle = zpartition.partition(
            model,
            config=CONFIGS["threshold-0"],
            shard_device=torch.device("cpu"),
            pin_memory=True,
        )
        assert all(p.ds_tensor.is_pinned() for p in model.parameters())
        assert all(u.shard.is_pinned() for u in handle.units)
        loss = model(batches(1, 4)[0].cuda())
        loss.backward()
        assert torch.isfinite(loss)
