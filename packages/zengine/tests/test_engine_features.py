"""The engine's other promises: memory of model states, bad configs, safe_get_*, fp16 overflow,
the user's own optimizer and scheduler, progress lines."""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import math
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
import zpartition
from zcomm.testing import DistributedTest

from ._helpers import TinyGPT, global_batches

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])


def _config(stage: int = 3, **extra: object) -> dict[str, object]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 16},
        **extra,
    }


def _step(engine: zengine.Engine, tokens: torch.Tensor) -> torch.Tensor:
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    return loss


class TestModelStateMemory(DistributedTest):
    @pytest.mark.parametrize("world_size", [2, 4])
    @pytest.mark.parametrize("bf16", [True, False])
    def test_stage3_holds_16_bytes_per_parameter_over_ranks(
        self, world_size: int, bf16: bool
    ) -> None:
        """bf16: 2 (shard) + 2 (gradient) + 12 (fp32 master, Adam's two moments); fp32: 4 + 4
        + 8, the shard being its own master."""
        model = TinyGPT(blocks=3)
        numels = [p.numel() for p in model.parameters()]
        engine, optimizer, *_ = zengine.initialize(
            model=model, config=_config(bf16={"enabled": bf16})
        )
        _step(engine, global_batches(1, 2)[0])
        handle = engine.partitioned
        assert handle is not None
        masters = optimizer.stepped_tensors()  # the fp32 masters, one per parameter
        in_shards = {u.shard.untyped_storage().data_ptr() for u in handle.units}
        own = [m for m in masters if m.untyped_storage().data_ptr() not in in_shards]
        assert len(own) == (len(masters) if bf16 else 0)  # fp32 shards are their own masters
        held = sum(m.nbytes for m in own)
        held += optimizer.grad_partitions_flat_buffer.nbytes
        held += sum(t.nbytes for s in optimizer.state.values() for t in s.values() if t.dim())
        held += sum(u.shard.nbytes for u in handle.units)
        persistent = [p for p in model.parameters() if p.ds_persist]
        held += sum(p.numel() * p.element_size() for p in persistent)  # gathered for good
        shards = sum(math.ceil(n / world_size) for n in numels)
        expected = 16 * shards + (2 if bf16 else 4) * sum(p.ds_numel for p in persistent)
        assert expected <= held <= expected + 16 * len(numels)  # shard alignment, at most
        assert held < 16 * sum(numels) / world_size * 1.25


class TestBadConfig(DistributedTest):
    @pytest.mark.parametrize("world_size", [1])
    def test_an_error_names_the_key_and_nothing_starts(self, world_size: int) -> None:
        model = TinyGPT()
        before = [p.detach().clone() for p in model.parameters()]
        bad = _config(zero_optimization={"stage": 3, "stage3_prefetch_bucket_sise": 10})
        with pytest.raises(zengine.ConfigError, match=r"stage3_prefetch_bucket_sise.*did you mean"):
            zengine.initialize(model=model, config=bad)
        for p, b in zip(model.parameters(), before, strict=True):
            assert not hasattr(p, "ds_id")
            torch.testing.assert_close(p, b)  # untouched: not partitioned, not moved
        engine, *_ = zengine.initialize(model=model, config=_config(stage=0))
        with pytest.raises(TypeError, match="loss must be a tensor of one element"):
            engine.backward(torch.ones(3))
        untouched = TinyGPT()
        schedule_only = {
            "train_batch_size": 2,
            "zero_optimization": {"stage": 3},
            "scheduler": {"type": "WarmupLR"},
        }
        with pytest.raises(ValueError, match="'scheduler' needs an optimizer, and there is none"):
            zengine.initialize(model=untouched, config=schedule_only)
        assert not any(hasattr(p, "ds_id") for p in untouched.parameters())


class TestWithoutOptimizer(DistributedTest):
    """As DeepSpeed's: no optimizer given nor configured makes an engine for forward passes
    (ZeRO-3 inference, Hugging Face's evaluation-only engine)."""

    @SIZES
    @pytest.mark.parametrize("stage", [0, 3])
    def test_forward_only(self, world_size: int, stage: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        plain = copy.deepcopy(model)
        zero = {"stage": stage, "stage3_param_persistence_threshold": 16}
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
        engine, optimizer, _, scheduler = zengine.initialize(model=model, config=config)
        assert optimizer is None
        assert scheduler is None
        assert engine.optimizer is None
        if stage == 3:  # partitioned as for training, without masters or gradient partitions
            assert all(zpartition.is_zero_param(p) for p in model.parameters())
        tokens = global_batches(1, 2)[0]
        with torch.no_grad():
            torch.testing.assert_close(engine(tokens), plain(tokens))
        for _ in range(2):  # recorded, then (on several ranks) following the recorded order
            loss = engine(tokens)  # with gradients: the backward is what is refused
            if stage == 3:  # no backward follows: only the persistent parameters stay gathered
                gathered = {n: p.numel() > 0 for n, p in model.named_parameters()}
                assert gathered == {n: p.ds_persist for n, p in model.named_parameters()}
                assert any(gathered.values())
        for call in (lambda: engine.backward(loss), engine.step, engine.get_lr):
            with pytest.raises(RuntimeError, match=r"has no optimizer .* forward passes only"):
                call()
        assert engine.get_global_grad_norm() is None
        assert engine.skipped_steps == 0
        engine.empty_partition_cache()
        assert stage == 0 or sum(p.numel() for p in model.parameters()) == 0
        engine.destroy()


class TestSafeGet(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_full_and_local_views(self, world_size: int, stage: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        shapes = {n: p.shape for n, p in model.named_parameters()}
        originals = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine, *_ = zengine.initialize(model=model, config=_config(stage))
        for name, p in model.named_parameters():
            full = zengine.safe_get_full_fp32_param(p)
            assert full is not None
            assert full.shape == shapes[name]
            torch.testing.assert_close(full, originals[name])
        _step(engine, global_batches(1, 2 * world_size)[0].chunk(world_size)[zcomm.get_rank()])
        weight = model.head.weight
        avg = zengine.safe_get_full_optimizer_state(weight, "exp_avg")
        local = zengine.safe_get_local_optimizer_state(weight, "exp_avg")
        assert avg is not None
        assert local is not None
        assert avg.shape == shapes["head.weight"]
        assert local.numel() <= avg.numel()
        zengine.safe_set_full_fp32_param(weight, torch.full(shapes["head.weight"], 0.5))
        full = zengine.safe_get_full_fp32_param(weight)
        assert full is not None
        assert torch.equal(full, torch.full(shapes["head.weight"], 0.5))
        with pytest.raises(KeyError, match="no optimizer state 'nope'"):
            zengine.safe_get_local_optimizer_state(weight, "nope")
        assert zengine.safe_get_full_fp32_param(nn.Parameter(torch.ones(2))) is None


class TestFp16(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("stage", [1, 3])
    def test_overflow_skips_the_step_and_lowers_the_scale(
        self, world_size: int, stage: int
    ) -> None:
        model = TinyGPT()
        fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
        engine, optimizer, *_ = zengine.initialize(model=model, config=_config(stage, fp16=fp16))
        tokens = global_batches(1, 2)[0]
        _step(engine, tokens)
        masters = torch.cat(optimizer.stepped_tensors())
        scale = optimizer.cur_scale
        loss = engine(tokens)
        engine.backward(loss * float("inf") if zcomm.get_rank() == 0 else loss)
        engine.step()
        assert optimizer.cur_scale == scale / 2
        assert optimizer.skipped_steps == engine.skipped_steps == 1
        assert not engine.was_step_applied()
        assert optimizer.overflow  # what Hugging Face Accelerate reads as step_was_skipped
        assert optimizer.loss_scale == optimizer.cur_scale
        # DeepSpeed's fp16 optimizers' attributes, which its tests and loops read
        assert optimizer.dynamic_loss_scale
        assert (optimizer.scale_window, optimizer.min_loss_scale) == (1000, 1.0)
        assert optimizer.cur_iter == 2
        assert optimizer.loss_scale_config.cur_scale == optimizer.cur_scale  # DeepSpeed 0.18's
        assert engine.sparse_tensor_module_names == set()  # sparse_gradients is refused
        assert engine.fp16_enabled()
        assert torch.equal(torch.cat(optimizer.stepped_tensors()), masters)
        assert torch.isfinite(masters).all()
        _step(engine, tokens)  # and training goes on
        assert engine.was_step_applied()
        assert not optimizer.overflow
        assert not torch.equal(torch.cat(optimizer.stepped_tensors()), masters)

    @SIZES
    @pytest.mark.parametrize("stage", [0, 1])
    def test_scale_follows_deepspeeds_optimizer_for_the_stage(
        self, world_size: int, stage: int
    ) -> None:
        """DeepSpeed scales stage 0 with its FP16_Optimizer, where the minimum scale is a
        floor, and its ZeRO stages with its DynamicLossScaler, which stops the run at the
        minimum; both raise at the same steps (these sequences are DeepSpeed 0.19.8's)."""
        fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
        fp16 |= {"hysteresis": 1, "min_loss_scale": 128}
        engine, optimizer, *_ = zengine.initialize(
            model=TinyGPT(), config=_config(stage, fp16=fp16)
        )
        tokens = global_batches(1, 2)[0]
        scales = []
        for overflow in [False, False, False, True, True, False, False, False]:
            loss = engine(tokens)
            engine.backward(loss * float("inf") if overflow and zcomm.get_rank() == 0 else loss)
            engine.step()
            scales.append(optimizer.cur_scale)
        assert scales == [256, 256, 512, 256, 128, 128, 128, 256]
        floor = optimizer.min_loss_scale
        assert floor == 128
        while optimizer.cur_scale > floor:  # down to the floor, then one more overflow
            loss = engine(tokens)
            engine.backward(loss * float("inf") if zcomm.get_rank() == 0 else loss)
            engine.step()
        loss = engine(tokens)
        engine.backward(loss * float("inf") if zcomm.get_rank() == 0 else loss)
        if stage == 0:
            engine.step()  # skipped, the scale stays at the floor, training goes on
            assert optimizer.cur_scale == floor
            _step(engine, tokens)
            assert engine.was_step_applied()
        else:
            with pytest.raises(zengine.MinLossScaleError, match="minimum"):
                engine.step()


def _trained(stage: int, world_size: int, run: Any, **extra: object) -> list[torch.Tensor]:
    """The full fp32 weights after `run(engine, tokens)` on this rank's share of two global
    batches (`extra`: more of the config)."""
    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = zengine.initialize(model=model, config=_config(stage, **extra))
    for batch in global_batches(2, 2 * world_size):
        run(engine, batch.chunk(world_size)[zcomm.get_rank()])
    full = [zengine.safe_get_full_fp32_param(p) for p in model.parameters()]
    engine.destroy()
    return [t for t in full if t is not None]


class TestZeroGradBetweenMicroBatches(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_zero_grad_drops_what_the_accumulation_summed(
        self, world_size: int, stage: int
    ) -> None:
        """As DeepSpeed's: a micro-batch whose gradients ``zero_grad`` dropped leaves the step
        as if it had not run (stages 0 and 1 kept summing it into the next step; stage 0 in
        bf16 accumulates in fp32 buffers, the other path)."""

        def first_dropped(engine: zengine.Engine, tokens: torch.Tensor) -> None:
            _step(engine, tokens)
            if engine.micro_steps == 1:
                engine.zero_grad()  # the first micro-batch's gradients go
            else:
                assert engine.was_step_applied()

        def first_never_ran(engine: zengine.Engine, tokens: torch.Tensor) -> None:
            if engine.micro_steps == 0:
                engine.step()  # the micro-batch counted, with no gradients
            else:
                _step(engine, tokens)
                assert engine.was_step_applied()

        extra = {"gradient_accumulation_steps": 2, "bf16": {"enabled": stage == 0}}
        dropped = _trained(stage, world_size, first_dropped, **extra)
        never_ran = _trained(stage, world_size, first_never_ran, **extra)
        for got, want in zip(dropped, never_ran, strict=True):
            assert torch.equal(got, want)


class TestZeroGradAtStage3(DistributedTest):
    @SIZES
    def test_the_step_still_sees_what_the_backward_reduced(self, world_size: int) -> None:
        """As DeepSpeed's stage 3 ([Note: zero_grad at stage 3]): ``zero_grad`` between a
        backward and the step leaves the reduced gradients to that step; a backward after it
        starts from zero."""

        def zeroed_before_the_step(engine: zengine.Engine, tokens: torch.Tensor) -> None:
            engine.backward(engine(tokens))
            engine.zero_grad()
            engine.step()

        def zeroed_between_backwards(engine: zengine.Engine, tokens: torch.Tensor) -> None:
            engine.backward(engine(tokens) * 3.0)  # forgotten at the next backward
            engine.zero_grad()
            engine.backward(engine(tokens))
            engine.step()

        expected = _trained(3, world_size, _step)
        for run in (zeroed_before_the_step, zeroed_between_backwards):
            for got, want in zip(_trained(3, world_size, run), expected, strict=True):
                assert torch.equal(got, want)


class TestAllreduceGradients(DistributedTest):
    """DeepSpeed's ``enable_backward_allreduce = False`` and ``allreduce_gradients()``."""

    @SIZES
    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_the_caller_reduces(self, world_size: int, stage: int) -> None:
        def reduced_by_the_caller(engine: zengine.Engine, tokens: torch.Tensor) -> None:
            engine.enable_backward_allreduce = False
            engine.backward(engine(tokens))
            engine.allreduce_gradients()
            engine.allreduce_gradients()  # twice: the second finds nothing left to do
            engine.step()

        def left_to_the_step(engine: zengine.Engine, tokens: torch.Tensor) -> None:
            engine.enable_backward_allreduce = False
            engine.backward(engine(tokens))
            engine.step()  # reduces what no call did

        expected = _trained(stage, world_size, _step)
        for run in (reduced_by_the_caller, left_to_the_step):
            for got, want in zip(_trained(stage, world_size, run), expected, strict=True):
                assert torch.equal(got, want)

    @SIZES
    @pytest.mark.parametrize("stage", [0, 1])
    def test_a_rank_that_skips_its_backward_joins_with_zeros(
        self, world_size: int, stage: int
    ) -> None:
        """A batch one rank drops (a NaN loss): ``zero_grad(); allreduce_gradients()`` there
        meets the others' reduction, as if it had contributed zero gradients."""
        skipping = world_size - 1

        def skip_on_the_last_rank(engine: zengine.Engine, tokens: torch.Tensor) -> None:
            loss = engine(tokens)
            if zcomm.get_rank() == skipping:
                engine.zero_grad()
                engine.allreduce_gradients()
            else:
                engine.backward(loss)
            engine.step()

        def zero_loss_on_the_last_rank(engine: zengine.Engine, tokens: torch.Tensor) -> None:
            loss = engine(tokens)
            engine.backward(loss * 0.0 if zcomm.get_rank() == skipping else loss)
            engine.step()

        expected = _trained(stage, world_size, zero_loss_on_the_last_rank)
        skipped = _trained(stage, world_size, skip_on_the_last_rank)
        for got, want in zip(skipped, expected, strict=True):
            assert torch.equal(got, want)


class TestRefreshFp32Params(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_weights_changed_outside_a_step_reach_the_masters(
        self, world_size: int, stage: int
    ) -> None:
        """bf16 weights set by hand after initialize (on every rank at stages 0-2; through a
        GatheredParameters block with a modifier rank at stage 3): the fp32 masters keep the
        old values, and the next step would overwrite the new ones, until DeepSpeed's
        ``optimizer.refresh_fp32_params()`` takes them in."""
        torch.manual_seed(0)
        model = TinyGPT()
        engine, optimizer, *_ = zengine.initialize(
            model=model, config=_config(stage, bf16={"enabled": True})
        )
        weight = model.head.weight
        with zengine.zero.GatheredParameters([weight], modifier_rank=0), torch.no_grad():
            if stage < 3 or zcomm.get_rank() == 0:
                weight.data.fill_(0.5)
        stale = zengine.safe_get_full_fp32_param(weight)
        assert stale is not None
        assert not torch.equal(stale, torch.full_like(stale, 0.5))
        optimizer.refresh_fp32_params()
        fresh = zengine.safe_get_full_fp32_param(weight)
        assert fresh is not None
        assert torch.equal(fresh, torch.full_like(fresh, 0.5))
        _step(engine, global_batches(1, 2)[0])
        after = zengine.safe_get_full_fp32_param(weight)
        assert after is not None
        assert (after - 0.5).abs().max() <= 0.011  # one Adam step of lr 1e-2 from 0.5


class TestUserOptimizerAndScheduler(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_optimizer_instance_and_scheduler(self, world_size: int) -> None:
        model = TinyGPT()
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        cfg = {k: v for k, v in _config().items() if k != "optimizer"}
        engine, optimizer, _, sched = zengine.initialize(
            model=model, optimizer=opt, lr_scheduler=scheduler, config=cfg
        )
        assert optimizer.optimizer is opt
        assert sched is scheduler
        tokens = global_batches(1, 2)[0]
        _step(engine, tokens)
        _step(engine, tokens)
        assert engine.get_lr() == [0.125]
        assert engine.get_mom() == [0.9]  # SGD's momentum
        assert (
            zengine.safe_get_local_optimizer_state(model.head.weight, "momentum_buffer") is not None
        )

    @pytest.mark.parametrize("world_size", [1])
    def test_step_hands_lr_kwargs_to_the_scheduler(self, world_size: int) -> None:
        class Recording:
            def __init__(self) -> None:
                self.calls: list[dict[str, Any]] = []

            def step(self, **kwargs: Any) -> None:
                self.calls.append(kwargs)

        scheduler = Recording()  # step() alone: initialize takes it, a checkpoint would not
        engine, *_ = zengine.initialize(
            model=TinyGPT(),
            config=_config(),
            lr_scheduler=scheduler,  # type: ignore[arg-type]
        )
        assert engine.get_mom() == [(0.9, 0.999)]  # Adam's betas
        tokens = global_batches(1, 2)[0]
        engine.backward(engine(tokens))
        engine.step(lr_kwargs={"increment": 2})
        engine.backward(engine(tokens))
        engine.step()
        assert scheduler.calls == [{"increment": 2}, {}]

    @pytest.mark.parametrize("world_size", [1])
    def test_config_scheduler_and_optimizer_class(self, world_size: int) -> None:
        cfg = _config(
            scheduler={
                "type": "WarmupLR",
                "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"},
            }
        )
        cfg.pop("optimizer")
        engine, _, _, sched = zengine.initialize(
            model=TinyGPT(), optimizer=lambda groups: torch.optim.SGD(groups, lr=1.0), config=cfg
        )
        tokens = global_batches(1, 2)[0]
        lrs = []
        for _ in range(5):
            _step(engine, tokens)
            lrs.append(engine.get_lr()[0])
        assert lrs == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1])  # DeepSpeed: lr(0) = min
        assert sched is engine.lr_scheduler


class TestOneCycleInTheEngine(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_one_cycle_moves_the_lr_and_adams_first_beta(self, world_size: int) -> None:
        params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.05, "cycle_first_step_size": 2}
        cfg = _config(2, scheduler={"type": "OneCycle", "params": params})
        engine, optimizer, _, _ = zengine.initialize(model=TinyGPT(), config=cfg)
        tokens = global_batches(1, 2 * world_size)[0].chunk(world_size)[zcomm.get_rank()]
        seen: list[float] = []
        for _ in range(4):
            _step(engine, tokens)
            seen += [engine.get_lr()[0], optimizer.param_groups[0]["betas"][0]]
        # up over 2 steps, down over 2: scale 0.5, 1, 0.5, 0 after steps 0..3 (lr, beta each)
        assert seen == pytest.approx([0.03, 0.85, 0.05, 0.8, 0.03, 0.85, 0.01, 0.9])


class TestConfigOptimizer(DistributedTest):
    @pytest.mark.parametrize("world_size", [1])
    @pytest.mark.parametrize(
        ("params", "kind", "fused"),
        [
            ({}, torch.optim.AdamW, True),  # DeepSpeed's Adam: decoupled decay, fused kernel
            ({"torch_adam": True}, torch.optim.AdamW, False),  # torch's per-tensor loop
            ({"adam_w_mode": False}, torch.optim.Adam, True),
            ({"foreach": True}, torch.optim.AdamW, False),  # torch takes one or the other
        ],
    )
    def test_adam_from_the_config(
        self, world_size: int, params: dict[str, object], kind: type, fused: bool
    ) -> None:
        cfg = _config(optimizer={"type": "Adam", "params": {"lr": 1e-2, **params}})
        engine, optimizer, _, _ = zengine.initialize(model=TinyGPT(), config=cfg)
        assert type(optimizer.optimizer) is kind
        assert optimizer.optimizer.defaults["fused"] is fused
        tokens = global_batches(1, 2)[0]
        first = _step(engine, tokens).item()
        assert _step(engine, tokens).item() < first


class TestAdagradFromTheConfig(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_adagrad_steps_as_torchs_on_one_process(self, world_size: int) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        params = {"lr": 0.05, "eps": 1e-8, "weight_decay": 0.01}
        cfg = _config(1, optimizer={"type": "adagrad", "params": params})
        engine, optimizer, _, _ = zengine.initialize(model=model, config=cfg)
        assert type(optimizer.optimizer) is torch.optim.Adagrad
        plain = torch.optim.Adagrad(reference.parameters(), lr=0.05, eps=1e-8, weight_decay=0.01)
        data = global_batches(3, 2 * world_size)
        for tokens in data:
            _step(engine, tokens.chunk(world_size)[zcomm.get_rank()])
            reference(tokens).backward()
            plain.step()
            plain.zero_grad()
        for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
            # fp32 sums in another order (2 ranks), which Adagrad's 1/sqrt(sum g^2) amplifies
            torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-4, atol=1e-5)


class TestProgress(DistributedTest):
    @pytest.mark.parametrize("world_size", [2])
    def test_a_line_every_steps_per_print_on_rank_0(self, world_size: int) -> None:
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("zengine").addHandler(handler)
        try:
            cfg = _config(steps_per_print=2, wall_clock_breakdown=True)
            engine, *_ = zengine.initialize(model=TinyGPT(), config=cfg)
            for _ in range(4):
                _step(engine, global_batches(1, 2)[0])
        finally:
            logging.getLogger("zengine").removeHandler(handler)
        progress = [line for line in lines if line.startswith("step=")]
        if zcomm.get_rank() == 0:
            assert [line.split()[0] for line in progress] == ["step=2", "step=4"]
            assert all("samples/s=" in line and "peak_mem=" in line for line in progress)
            assert any(line.startswith("time per step: forward") for line in lines)
        else:
            assert progress == []


class TestNoGrowth(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("stage", [1, 3])
    def test_live_tensors_do_not_grow_with_steps(self, world_size: int, stage: int) -> None:
        import gc

        engine, *_ = zengine.initialize(model=TinyGPT(), config=_config(stage))
        tokens = global_batches(1, 2)[0]

        def tensors() -> dict[str, int]:
            gc.collect()
            kinds: dict[str, int] = {}
            for o in gc.get_objects():
                if isinstance(o, torch.Tensor):
                    # in words: a fake tensor an earlier compiled test left has symbolic sizes,
                    # which do not hash
                    kind = f"{o.dtype} {list(o.shape)}"
                    kinds[kind] = kinds.get(kind, 0) + 1
            return kinds

        def steps(n: int) -> dict[str, int]:
            for _ in range(n):
                _step(engine, tokens)
            return tensors()

        # A leak grows with every window of steps; a tensor that a thread left over from an
        # earlier test in these pooled workers frees (or a moment's buffer) does not. So a
        # count that differs after the first window is measured once more before it fails.
        counts = [steps(10), steps(40)]
        if counts[1] != counts[0]:
            counts.append(steps(40))
        total = [sum(c.values()) for c in counts]
        growing = {
            kind: [c.get(kind, 0) for c in counts]
            for kind in set().union(*counts)
            if len({c.get(kind, 0) for c in counts}) > 1
        }
        assert not all(a < b for a, b in itertools.pairwise(total)), (
            f"live tensors after 10, 50 and 90 steps: {total}; by dtype and shape: {growing}"
        )


class _WithMethod(TinyGPT):
    config = "the model's"  # the engine has a config of its own

    def greeting(self) -> str:
        return "hello"


class TestAttributesOfTheModel(DistributedTest):
    @pytest.mark.parametrize("world_size", [1])
    def test_unknown_attributes_come_from_the_module(self, world_size: int) -> None:
        """As DeepSpeed's engine: ``engine.generate(...)`` and the like reach the model."""
        model = _WithMethod()
        engine, *_ = zengine.initialize(model=model, config=_config(stage=3))
        assert engine.greeting() == "hello"
        first = next(iter(model.named_children()))
        assert getattr(engine, first[0]) is first[1]  # a submodule, by its name
        # the engine's own attributes come first: its config, not the model's string
        assert model.config == "the model's"
        assert type(engine.config).__name__ == "EngineConfig"
        with pytest.raises(AttributeError, match=r"neither the engine \(Engine\) nor its module"):
            engine.no_such_thing  # noqa: B018
        assert not hasattr(engine, "no_such_thing")


class TestUnwrapModelForGeneration(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("stage", [1, 3])
    def test_gathered_without_hooks_inside(self, world_size: int, stage: int) -> None:
        """DeepSpeed's ``unwrap_model_for_generation``: the whole model gathered once and no
        ZeRO-3 hooks inside; training after it goes on as if it had not been there."""
        data = global_batches(4, 2 * world_size)
        rank = zcomm.get_rank()
        runs = []
        for generate in (False, True):
            torch.manual_seed(0)
            engine, *_ = zengine.initialize(model=TinyGPT(), config=_config(stage))
            losses = []
            for i, tokens in enumerate(data):
                if generate and i == 2:
                    with zengine.zero.unwrap_model_for_generation(engine) as unwrapped:
                        assert unwrapped is engine
                        modules = list(engine.module.modules())
                        assert not any(m._forward_pre_hooks for m in modules)
                        assert all(
                            p.shape == p.ds_shape for p in engine.module.parameters() if stage == 3
                        )
                        with torch.no_grad():
                            unwrapped(tokens)
                    assert stage != 3 or engine.module.embed._forward_pre_hooks
                losses.append(_step(engine, tokens.chunk(world_size)[rank]).item())
            runs.append(losses)
        assert runs[0] == runs[1]
        generation = zengine.zero.unwrap_model_for_generation(TinyGPT())  # type: ignore[type-var]
        with pytest.raises(TypeError, match=r"expected the engine zengine\.initialize returned"):
            generation.__enter__()

    @SIZES
    def test_hooks_taken_off_and_put_back_through_parameter_offload(self, world_size: int) -> None:
        """TRL's ZeRO-3 generation, step by step as its ``remove_hooks``/``add_hooks`` do it
        on DeepSpeed's ``optimizer.parameter_offload``: inside ``GatheredParameters``, each
        parameter's ``ds_active_sub_modules`` cleared, the hook handles removed and their
        lists emptied, plain forwards, then ``_register_deepspeed_module``. The forwards
        inside give the unpartitioned model's output, and training goes on as if the detour
        had not been there."""
        data = global_batches(4, 2 * world_size)
        rank = zcomm.get_rank()
        plain = TinyGPT()
        runs = []
        for generate in (False, True):
            torch.manual_seed(0)
            engine, optimizer, *_ = zengine.initialize(model=TinyGPT(), config=_config(3))
            offload = optimizer.parameter_offload
            assert offload is optimizer.parameter_offload  # one object: tools assign to it
            losses = []
            for i, tokens in enumerate(data):
                if generate and i == 2:
                    with zengine.zero.GatheredParameters(list(engine.parameters())):
                        module = offload.module
                        plain.load_state_dict(
                            {k: v.clone() for k, v in module.state_dict().items()}
                        )
                        named = [p for _, p in module.named_parameters(recurse=True)]
                        # a method zpartition sets on the module itself
                        external = [p for _, p in module.ds_external_parameters()]  # type: ignore[operator]
                        for p in named + external:
                            p.ds_active_sub_modules.clear()
                        assert len(offload.forward_hooks) == 1
                        for hook in offload.forward_hooks + offload.backward_hooks:
                            hook.remove()
                        offload.forward_hooks, offload.backward_hooks = [], []
                        assert offload.forward_hooks == []  # a view of the hooks, now off
                        assert not any(m._forward_pre_hooks for m in module.modules())
                        with torch.no_grad():
                            for _ in range(2):  # token after token: nothing is released
                                assert torch.equal(engine(tokens), plain(tokens))
                        offload._register_deepspeed_module(module)
                    assert engine.module.embed._forward_pre_hooks
                losses.append(_step(engine, tokens.chunk(world_size)[rank]).item())
            runs.append(losses)
            with pytest.raises(ValueError, match="hooks the partitioned model as a whole"):
                offload._register_deepspeed_module(engine.module.get_submodule("embed"))
        assert runs[0] == runs[1]
        stage_1, *_ = zengine.initialize(model=TinyGPT(), config=_config(1))
        assert not hasattr(stage_1.optimizer, "parameter_offload")  # DeepSpeed's: stage 3 only


class TestScriptArguments(DistributedTest):
    @pytest.mark.parametrize("world_size", [2])
    def test_a_deepspeed_script_s_flags_and_init(self, world_size: int, tmp_path: Any) -> None:
        # DeepSpeedExamples' way: the script's parser gets DeepSpeed's flags, the launcher's
        # --local_rank, then init_distributed() and initialize(args=args)
        path = tmp_path / f"ds_config_{zcomm.get_rank()}.json"
        path.write_text(json.dumps(_config(stage=2)))
        parser = argparse.ArgumentParser()
        parser.add_argument("--local_rank", type=int, default=-1)
        assert zengine.add_config_arguments(parser) is parser
        assert "--deepscale" not in parser.format_help()  # DeepSpeed's old names stay hidden
        args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
        assert args.deepspeed
        assert args.deepspeed_config == str(path)
        zengine.init_distributed()  # already initialized: nothing to do, as DeepSpeed's
        torch.manual_seed(0)
        model = TinyGPT()
        engine, *_ = zengine.initialize(args=args, model=model)
        assert engine.zero_optimization_stage() == 2
        tokens = global_batches(1, 2 * world_size)[0].chunk(world_size)[zcomm.get_rank()]
        assert torch.isfinite(_step(engine, tokens))


def test_initialize_without_a_model_names_the_positional_mistake() -> None:
    """DeepSpeed asserts a model (its first positional parameter is args): the error is a
    ValueError and an AssertionError, and says where a model passed positionally went."""
    config = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ValueError, match=r"model is required$"):
        zengine.initialize(model=None, config=config)
    with pytest.raises(AssertionError, match=r"a module \(Linear\) came as the first positional"):
        zengine.initialize(nn.Linear(2, 2), config=config)


class TestDeepspeedIo(DistributedTest):
    """``engine.deepspeed_io`` (DeepSpeed's): the loader `initialize(training_data=...)` returns
    is made by it, so a test that patches it on the class (DeepSpeed's own test helpers do, to
    keep loader workers out of their process pools) reaches `initialize`'s loader too."""

    @SIZES
    def test_initialize_makes_its_loader_through_deepspeed_io(self, world_size: int) -> None:
        data = torch.utils.data.TensorDataset(torch.arange(24.0).unsqueeze(1))
        seen: list[dict[str, Any]] = []
        original = zengine.Engine.deepspeed_io

        def patched(self: zengine.Engine, *args: Any, **kwargs: Any) -> Any:
            kwargs["num_local_io_workers"] = 0
            seen.append(kwargs)
            return original(self, *args, **kwargs)

        zengine.Engine.deepspeed_io = patched  # type: ignore[method-assign]
        try:
            engine, _, loader, _ = zengine.initialize(
                model=nn.Linear(1, 1), config=_config(stage=2), training_data=data
            )
        finally:
            zengine.Engine.deepspeed_io = original  # type: ignore[method-assign]
        assert len(seen) == 1
        assert loader is engine.training_dataloader
        assert loader is not None
        rows = torch.cat([batch[0] for batch in loader]).flatten()
        assert all(len(batch[0]) == 2 for batch in loader)  # the config's micro-batch
        everyone = [torch.empty_like(rows) for _ in range(world_size)]
        torch.distributed.all_gather(everyone, rows)
        assert sorted(torch.cat(everyone).tolist()) == list(range(24))  # each rank its share

    @SIZES
    def test_deepspeed_io_takes_deepspeeds_arguments(self, world_size: int) -> None:
        engine, *_ = zengine.initialize(model=nn.Linear(1, 1), config=_config(stage=0))
        data = torch.utils.data.TensorDataset(torch.arange(8.0))
        sequential = torch.utils.data.SequentialSampler(data)
        loader = engine.deepspeed_io(
            data, batch_size=4, route="eval", data_sampler=sequential, num_local_io_workers=0
        )
        assert [batch[0].tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert engine.deepspeed_io(data).batch_size == 2
