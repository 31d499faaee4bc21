"""The engine against plain single-process PyTorch: ZeRO stages 0-3 at world sizes 1, 2, 4."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest

from ._helpers import (
    LR,
    TinyGPT,
    engine_config,
    global_batches,
    mixed_precision_losses,
    plain_losses,
    run_with_plain,
    train_engine,
)

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
STAGES = pytest.mark.parametrize("stage", [0, 1, 2, 3])


def _full(param: torch.Tensor) -> torch.Tensor:
    value = zengine.safe_get_full_fp32_param(param)
    assert value is not None
    return value.clone()


def _moved(run: Any) -> int:
    """How many collectives `run()` issued on this rank (zcomm's accounting)."""
    zcomm.enable_comm_accounting()
    zcomm.reset_comm_accounting()
    try:
        run()
        return sum(s.count for s in zcomm.comm_summary().values())
    finally:
        zcomm.enable_comm_accounting(False)


class TestParity(DistributedTest):
    @SIZES
    @STAGES
    def test_fp32_losses_match_plain_pytorch(self, world_size: int, stage: int) -> None:
        losses, expected = run_with_plain(stage, world_size)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)

    @pytest.mark.parametrize("world_size", [1, 2])
    @STAGES
    def test_gradient_accumulation(self, world_size: int, stage: int) -> None:
        losses, expected = run_with_plain(stage, world_size, steps=5, micro=1, accumulation=3)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)

    @pytest.mark.parametrize("world_size", [1, 2])
    @STAGES
    def test_gradient_clipping(self, world_size: int, stage: int) -> None:
        losses, expected = run_with_plain(stage, world_size, steps=5, gradient_clipping=0.05)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)

    @pytest.mark.parametrize("world_size", [2])
    @pytest.mark.parametrize("stage", [1, 3])
    @pytest.mark.parametrize("precision", ["bf16", "fp16"])
    def test_half_precision_is_deepspeeds_mixed_precision(
        self, world_size: int, stage: int, precision: str
    ) -> None:
        # against `mixed_precision_losses`: the model in the half dtype, fp32 masters, the
        # gradients averaged across the ranks in the half dtype (a sum, then halved), widened
        # and unscaled in fp32. fp16's dynamic scale starts where the first steps overflow:
        # one overflow spends the hysteresis, the next halves the scale, the rest step.
        # Bit-exact on CPU (gloo): the same kernels on the same shapes; two ranks' sum is one
        # rounding whatever the order (four ranks' would round by gloo's order); torch's fused
        # AdamW steps each element alone, so flat partitions step as the whole tensors do.
        half: dict[str, Any] = {"enabled": True}
        if precision == "fp16":
            half |= {"loss_scale": 0, "initial_scale_power": 18}
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        cfg = engine_config(stage)
        cfg[precision] = half
        engine, *_ = zengine.initialize(model=model, config=cfg)
        data = global_batches(4, 2 * world_size)
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        expected, masters = mixed_precision_losses(
            reference, data, dtype, world=world_size, fp16=half if precision == "fp16" else None
        )
        torch.testing.assert_close(train_engine(engine, data), expected, rtol=0, atol=0)
        assert engine.skipped_steps == (2 if precision == "fp16" else 0)
        found = [_full(p) for p in model.parameters()]
        # fp16 at stage 3 too: the step widens the gradient partition before it unscales it
        for a, b in zip(found, masters, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


class TestSteps(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("stage", [0, 1])
    def test_no_sync_holds_the_reduction_for_the_next_backward(
        self, world_size: int, stage: int
    ) -> None:
        # backward(a) inside no_sync, then backward(b): the step of one backward of a + b
        torch.manual_seed(0)
        model = TinyGPT()
        twin = copy.deepcopy(model)
        rank = zcomm.get_rank()
        a, b = (t[2 * rank : 2 * rank + 2] for t in global_batches(2, 2 * world_size))
        engine, *_ = zengine.initialize(model=model, config=engine_config(stage))
        with engine.no_sync():
            assert _moved(lambda: engine.backward(engine(a))) == 0
            # RuntimeErrors, and AssertionErrors with DeepSpeed's words, as its tests expect
            with pytest.raises(AssertionError, match=r"illegal to call Engine\.step\(\) inside"):
                engine.step()
            with pytest.raises(RuntimeError, match="reentry is unsupported"), engine.no_sync():
                pass
        assert (_moved(lambda: engine.backward(engine(b))) > 0) == (world_size > 1)
        engine.step()
        other, *_ = zengine.initialize(model=twin, config=engine_config(stage))
        other.backward(other(a) + other(b))
        other.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(_full(p), _full(q))

    @pytest.mark.parametrize("world_size", [1, 2])
    @STAGES
    def test_boundary_set_by_the_caller_as_accelerate_does(
        self, world_size: int, stage: int
    ) -> None:
        # Accelerate: set the boundary before each micro-batch, step() after the last only;
        # the same training as the engine's own count
        torch.manual_seed(0)
        model = TinyGPT()
        twin = copy.deepcopy(model)
        cfg = engine_config(stage, micro=1, accumulation=2)
        data = global_batches(3, 2 * world_size)
        engine, *_ = zengine.initialize(model=model, config=cfg)
        rank = zcomm.get_rank()
        for tokens in data:
            pieces = tokens.view(2, world_size, 1, -1)
            for k in range(2):
                engine.set_gradient_accumulation_boundary(k == 1)
                engine.backward(engine(pieces[k, rank]))
                if k == 1:
                    engine.step()
                    assert engine.was_step_applied()
        assert engine.global_steps == 3
        other, *_ = zengine.initialize(model=twin, config=cfg)
        train_engine(other, data)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(_full(p), _full(q))
        with pytest.raises(TypeError, match="expected a bool"):
            engine.set_gradient_accumulation_boundary(1)  # type: ignore[arg-type]

    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("stage", [1, 3])
    def test_set_train_batch_size_accumulates_more(self, world_size: int, stage: int) -> None:
        # two steps of 2 samples a rank, then DeepSpeed's call: two steps of 4 (2 micro-batches)
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        engine, *_ = zengine.initialize(model=model, config=engine_config(stage))
        data = global_batches(2, 2 * world_size) + global_batches(2, 4 * world_size, seed=8)
        losses = train_engine(engine, data[:2])
        engine.set_train_batch_size(4 * world_size)
        assert engine.gradient_accumulation_steps() == 2
        assert engine.train_batch_size() == 4 * world_size
        losses += train_engine(engine, data[2:])
        assert engine.global_steps == 4
        torch.testing.assert_close(losses, plain_losses(reference, data, lr=LR), rtol=1e-5, atol=0)
        for bad in (3 * world_size, 0, 4.0):
            with pytest.raises(ValueError, match="positive multiple"):
                engine.set_train_batch_size(bad)  # type: ignore[arg-type]

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_empty_partition_cache_releases_what_a_forward_kept(self, world_size: int) -> None:
        # a forward with gradients keeps its gathered parameters for the backward; emptying the
        # cache releases them, and the backward that still comes gathers them again
        # and, as DeepSpeed's, the persistent parameters (the norms' and biases' here) too
        zero = {"stage": 3, "stage3_param_persistence_threshold": 64}
        torch.manual_seed(0)
        model = TinyGPT()
        twin = copy.deepcopy(model)
        engines = [
            zengine.initialize(model=m, config=engine_config(3, zero_optimization=zero))[0]
            for m in (model, twin)
        ]
        rank = zcomm.get_rank()
        for step, tokens in enumerate(global_batches(3, 2 * world_size)):
            mine = tokens[2 * rank : 2 * rank + 2]
            for k, engine in enumerate(engines):
                loss = engine(mine)
                if k == 0:
                    assert engine.partitioned is not None
                    live = engine.partitioned.coordinator.channel
                    # kept from the second pass on, once the trace says a backward comes
                    assert live.live_numel > 0 or step == 0 or world_size == 1
                    engine.empty_partition_cache()
                    assert live.live_numel == 0
                    assert sum(p.numel() for p in model.parameters()) == 0
                engine.backward(loss)
                engine.step()
        assert any(p.ds_persist for p in model.parameters())
        engines[0].empty_partition_cache()  # after a step; the next forward gathers again
        assert sum(p.numel() for p in model.parameters()) == 0
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(_full(p), _full(q), rtol=0, atol=0)

    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("stage", [0, 1])
    def test_no_grad_is_left_to_read_or_write_after_the_reduction(
        self, world_size: int, stage: int
    ) -> None:
        # the reduced gradients are in the partitions; .grad is None, as DeepSpeed's ZeRO leaves
        # it (it read zeros, and a write into it leaked into the next step's gradients)
        torch.manual_seed(0)
        model = TinyGPT()
        twin = copy.deepcopy(model)
        engines = [
            zengine.initialize(model=m, config=engine_config(stage))[0] for m in (model, twin)
        ]
        rank = zcomm.get_rank()
        for tokens in global_batches(3, 2 * world_size):
            for k, engine in enumerate(engines):
                engine.backward(engine(tokens[2 * rank : 2 * rank + 2]))
                if k == 0:
                    assert all(p.grad is None for p in model.parameters())
                    grad = zengine.safe_get_full_grad(model.head.weight)
                    assert grad is not None
                    assert grad.abs().sum() > 0
                    for p in model.parameters():
                        p.grad = torch.full_like(p, 100.0)  # dropped: the step does not use it
                engine.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)

    @pytest.mark.parametrize("world_size", [1])
    @pytest.mark.parametrize("stage", [2, 3])
    def test_no_sync_is_refused_where_gradients_are_partitioned(
        self, world_size: int, stage: int
    ) -> None:
        engine, *_ = zengine.initialize(model=TinyGPT(), config=engine_config(stage))
        with pytest.raises(RuntimeError, match=f"stage {stage} partitions"), engine.no_sync():
            pass
        with pytest.raises(AssertionError, match="no_sync context manager is incompatible"):
            engine.no_sync().__enter__()

    @pytest.mark.parametrize("world_size", [1, 2])
    @STAGES
    def test_step_acts_at_the_boundary_only(self, world_size: int, stage: int) -> None:
        model = TinyGPT()
        cfg = engine_config(stage, micro=1, accumulation=2)
        engine, *_ = zengine.initialize(model=model, config=cfg)
        assert engine.train_batch_size() == 2 * world_size
        tokens = global_batches(1, 1)[0]
        before = _full(model.head.weight)
        assert not engine.is_gradient_accumulation_boundary()
        engine.backward(engine(tokens))
        engine.step()
        assert engine.global_steps == 0
        torch.testing.assert_close(_full(model.head.weight), before)
        assert not engine.was_step_applied()
        assert engine.is_gradient_accumulation_boundary()
        engine.backward(engine(tokens))
        engine.step()
        assert engine.global_steps == 1
        assert engine.was_step_applied()
        assert not torch.equal(_full(model.head.weight), before)
        assert engine.get_global_grad_norm() is not None
        assert engine.get_lr() == [LR]
        # DeepSpeed's accessors are methods
        assert engine.zero_optimization_stage() == stage
        assert (engine.fp16_enabled(), engine.bfloat16_enabled()) == (False, False)
        assert engine.gradient_clipping() == cfg.get("gradient_clipping", 0.0)
        assert engine.steps_per_print() == cfg.get("steps_per_print", 10)
        assert engine.skipped_steps == 0
        assert (engine.global_rank, engine.world_size) == (zcomm.get_rank(), world_size)
        assert engine.dp_world_size == world_size
        assert engine.local_rank == zcomm.get_local_rank()


class TestCompile(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("stage", [1, 3])
    def test_a_compiled_engine_trains_as_plain_pytorch(self, world_size: int, stage: int) -> None:
        # engine.compile() (nn.Module's, which Accelerate calls): at stage 3 the ZeRO hooks run
        # between the compiled graphs, which a graph cannot hold (they move the parameters'
        # storage); before, the compiler failed on their views of other dtypes
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
        engine, *_ = zengine.initialize(
            model=model, config=engine_config(stage, zero_optimization=zero)
        )
        engine.compile()
        data = global_batches(3, 2 * world_size)
        expected = plain_losses(reference, data, lr=LR)
        torch.testing.assert_close(train_engine(engine, data), expected, rtol=1e-5, atol=0)
        engine.destroy()
