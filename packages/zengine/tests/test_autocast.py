"""``torch_autocast``: fp32 parameters and optimizer, the forward under ``torch.autocast``, the
lower-precision-safe modules' gradients reduced in the autocast dtype (DeepSpeed's section)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zengine._config import ConfigError
from zengine._optim._grad_buckets import _cut

from ._helpers import (
    LR,
    PipeReference,
    TinyGPT,
    WithLoss,
    engine_config,
    global_batches,
    pipe_config,
    pipe_initialize,
    pipe_train,
    pipeline,
    train_engine,
)

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
STAGES = pytest.mark.parametrize("stage", [0, 1, 2, 3])
BF16 = {"enabled": True, "dtype": "bf16"}


def _autocast_losses(
    model: nn.Module,
    data: list[torch.Tensor],
    dtype: torch.dtype,
    *,
    world: int = 1,
    scaler: bool = False,
) -> list[float]:
    """Plain PyTorch AMP in one process: fp32 AdamW, the forward under autocast (each batch in
    `world` pieces, as the ranks see it: autocast's matmuls round by their shapes), and with
    fp16 torch's GradScaler."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scale = torch.amp.GradScaler("cpu", enabled=scaler)
    losses = []
    for tokens in data:
        total = 0.0
        for piece in tokens.view(world, -1, tokens.shape[-1]):
            with torch.autocast("cpu", dtype=dtype):
                loss = model(piece)
            scale.scale(loss / world).backward()
            total += loss.item() / world
        scale.step(opt)
        scale.update()
        opt.zero_grad()
        losses.append(total)
    return losses


def _narrow_losses(
    model: nn.Module, data: list[torch.Tensor], dtype: torch.dtype, *, world: int
) -> list[float]:
    """Plain PyTorch autocast as the engine runs it with Linear lower-precision safe: each
    rank's gradients apart, averaged across the ranks (a sum in rank order, then a division)
    in `dtype` for Linear's parameters and in fp32 for the others; fused AdamW (DeepSpeed's)."""
    params = list(model.parameters())
    narrow = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)
    losses = []
    for tokens in data:
        seen, ranks = [], []
        for piece in tokens.view(world, -1, tokens.shape[-1]):
            with torch.autocast("cpu", dtype=dtype):
                loss = model(piece)
            loss.backward()
            seen.append(loss.detach().float())
            mine = []
            for p in params:
                assert p.grad is not None
                mine.append(p.grad.to(dtype) if id(p) in narrow else p.grad)
            ranks.append(mine)
            opt.zero_grad()
        grads = ranks[0]
        for other in ranks[1:]:
            grads = [g + h for g, h in zip(grads, other, strict=True)]
        for p, g in zip(params, grads, strict=True):
            p.grad = (g / world).float()
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(seen).mean().item())
    return losses


def _run(
    stage: int,
    world: int,
    autocast: dict[str, Any],
    steps: int = 6,
    *,
    narrow: bool = False,
    **extra: Any,
) -> tuple[list[float], list[float], zengine.Engine]:
    """The engine against `_autocast_losses`, or with `narrow` against `_narrow_losses`."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    cfg = engine_config(stage, torch_autocast=autocast, **extra)
    engine, *_ = zengine.initialize(model=model, config=cfg)
    data = global_batches(steps, cfg["train_micro_batch_size_per_gpu"] * world)
    dtype = torch.float16 if autocast.get("dtype") == "fp16" else torch.bfloat16
    if narrow:
        expected = _narrow_losses(reference, data, dtype, world=world)
    else:
        expected = _autocast_losses(
            reference, data, dtype, world=world, scaler=dtype == torch.float16
        )
    return train_engine(engine, data), expected, engine


class TestParity(DistributedTest):
    @SIZES
    @STAGES
    def test_losses_follow_plain_pytorch_autocast(self, world_size: int, stage: int) -> None:
        # no module is lower-precision safe: every gradient is reduced in fp32, as PyTorch's
        losses, expected, engine = _run(
            stage, world_size, {**BF16, "lower_precision_safe_modules": []}
        )
        # bf16 moves TinyGPT's losses ~1e-4 from fp32's: 1e-5 tells them apart
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
        assert all(p.dtype == torch.float32 for p in engine.module.parameters())
        engine.destroy()

    @pytest.mark.parametrize("world_size", [2, 4])
    @pytest.mark.parametrize("stage", [1, 3])
    def test_gradients_reduced_in_bf16_still_follow(self, world_size: int, stage: int) -> None:
        # Linear's gradients reduced in bf16 (the default safe modules), in small buckets, as
        # `_narrow_losses` reduces them: bit-exact on two ranks; four ranks' bf16 sums round in
        # gloo's order, not the reference's rank order (measured: 1.1e-4 apart at most)
        zero = {"stage": stage, "reduce_bucket_size": 600}
        losses, expected, engine = _run(
            stage, world_size, BF16, narrow=True, zero_optimization=zero
        )
        rtol = 0.0 if world_size == 2 else 5e-4
        torch.testing.assert_close(losses, expected, rtol=rtol, atol=0)
        engine.destroy()

    @pytest.mark.parametrize("world_size", [2])
    @pytest.mark.parametrize("stage", [0, 3])
    def test_fp16_scales_the_loss_as_grad_scaler(self, world_size: int, stage: int) -> None:
        autocast = {"enabled": True, "dtype": "fp16", "lower_precision_safe_modules": []}
        losses, expected, engine = _run(stage, world_size, autocast)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
        assert engine.optimizer.loss_scaler.dynamic
        assert engine.optimizer.cur_scale == 2.0**16  # GradScaler's start; no overflow yet
        engine.destroy()


class TestWithOffload(DistributedTest):
    @pytest.mark.parametrize("world_size", [2])
    @pytest.mark.parametrize("stage", [2, 3])
    def test_offloaded_states_follow_plain_pytorch_autocast(
        self, world_size: int, stage: int, tmp_path: Path
    ) -> None:
        # the masters and the step on the host; at stage 3 the shards in NVMe files too, the
        # Linear ones gathered narrow from what the files give back
        zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
        safe: dict[str, Any] = {"lower_precision_safe_modules": []}
        if stage == 3:
            folder = tmp_path / f"rank{zcomm.get_rank()}"
            zero["offload_param"] = {"device": "nvme", "nvme_path": str(folder)}
            zero["stage3_param_persistence_threshold"] = 0
            safe = {}  # Linear: narrow gathers and bf16 reductions, as `_narrow_losses`'s
        losses, expected, engine = _run(
            stage, world_size, {**BF16, **safe}, narrow=not safe, zero_optimization=zero
        )
        torch.testing.assert_close(losses, expected, rtol=1e-5 if safe else 0.0, atol=0)
        engine.destroy()


class _OneLinear(nn.Module):
    """A Linear (lower-precision safe) and a parameter of the root (not): with w = s = 1,
    d/dw = x and d/ds = x."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(1, 1, bias=False)
        self.s = nn.Parameter(torch.ones(1))
        with torch.no_grad():
            self.w.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w(x).float() * self.s).sum()


class TestCommDtype(DistributedTest):
    @SIZES
    @STAGES
    def test_safe_modules_gradients_are_reduced_in_the_autocast_dtype(
        self, world_size: int, stage: int
    ) -> None:
        # Rank 0's gradients are 1, the others' 2**-9: their fp32 mean is exact, a bf16 sum
        # (8 significant bits) rounds 1 + 2**-9 away.
        config = engine_config(stage, micro=1, torch_autocast=BF16)
        # one parameter a bucket at stages 0-2: a bucket of both would go in fp32
        config["zero_optimization"] |= {"reduce_bucket_size": 1}
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.0}}
        model = _OneLinear()
        engine, *_ = zengine.initialize(model=model, config=config)
        assert zengine.get_comm_dtype(model.w.weight) == torch.bfloat16
        assert zengine.get_comm_dtype(model.s) == torch.float32
        x = 1.0 if zcomm.get_rank() == 0 else 2.0**-9
        engine.backward(engine(torch.tensor([[x]])))
        w, s = zengine.safe_get_full_grad(model.w.weight), zengine.safe_get_full_grad(model.s)
        assert w is not None
        assert s is not None
        exact = (1.0 + (world_size - 1) * 2.0**-9) / world_size
        assert s.item() == exact
        if world_size == 1:
            assert w.item() == exact
        else:
            assert w.item() != exact, "reduced in fp32"
            assert w.item() == torch.tensor(w.item()).bfloat16().item()
        engine.step()
        engine.destroy()

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_the_listed_classes_are_marked(self, world_size: int) -> None:
        safe = ["torch.nn.LayerNorm", "torch.nn.Embedding"]
        config = engine_config(1, torch_autocast={**BF16, "lower_precision_safe_modules": safe})
        model = TinyGPT()
        engine, *_ = zengine.initialize(model=model, config=config)
        marked = {n for n, p in model.named_parameters() if zengine.has_comm_dtype(p)}
        assert marked == {"embed.weight"} | {
            f"blocks.{i}.norm.{k}" for i in range(2) for k in ("weight", "bias")
        }
        engine.destroy()


def test_buckets_are_cut_where_the_comm_dtype_changes() -> None:
    params = [nn.Parameter(torch.zeros(4)) for _ in range(5)]
    for i in (0, 1, 4):
        params[i].comm_dtype = torch.bfloat16
    pairs = [(p, 4 * i) for i, p in enumerate(params)]
    flat = torch.zeros(20)
    # a group in several buckets: runs of one comm dtype, each reduced in it
    cut = _cut(0, pairs, flat, 12, torch.float32)
    assert [(b.lo, b.hi, b.dtype) for b in cut] == [
        (0, 8, torch.bfloat16),
        (8, 16, torch.float32),
        (16, 20, torch.bfloat16),
    ]
    # a group that is one bucket stays one, reduced in the wider dtype (a reduce-scatter)
    assert [(b.lo, b.hi, b.dtype) for b in _cut(0, pairs, flat, 20, torch.float32)] == [
        (0, 20, torch.float32)
    ]
    marked = [(p, off) for p, off in pairs if hasattr(p, "comm_dtype")]
    assert [b.dtype for b in _cut(0, marked, torch.zeros(12), 100, torch.float32)] == [
        torch.bfloat16
    ]


class TestForward(DistributedTest):
    @pytest.mark.parametrize("world_size", [1])
    def test_the_forward_runs_under_autocast(self, world_size: int) -> None:
        def output_dtype(autocast: dict[str, Any], outer: torch.dtype | None) -> torch.dtype:
            torch.manual_seed(0)
            engine, *_ = zengine.initialize(
                model=nn.Linear(4, 4), config=engine_config(0, torch_autocast=autocast)
            )
            with torch.autocast("cpu", dtype=outer or torch.bfloat16, enabled=outer is not None):
                dtype = engine(torch.randn(2, 4)).dtype
            engine.destroy()
            return dtype

        assert output_dtype(BF16, None) == torch.bfloat16
        assert output_dtype({"enabled": False}, None) == torch.float32
        # the caller's autocast: kept when the section is off, overridden when it is on
        assert output_dtype({"enabled": False}, torch.float16) == torch.float16
        assert output_dtype(BF16, torch.float16) == torch.bfloat16

    @pytest.mark.parametrize("world_size", [1])
    def test_a_class_that_cannot_be_found_is_named(self, world_size: int) -> None:
        safe = ["torch.nn.Linear", "torch.nn.NoSuchModule", "no_such_package.Linear"]
        config = engine_config(1, torch_autocast={**BF16, "lower_precision_safe_modules": safe})
        with pytest.raises(ConfigError) as error:
            zengine.initialize(model=nn.Linear(4, 4), config=config)
        text = str(error.value)
        assert "lower_precision_safe_modules[1]" in text
        assert "NoSuchModule" in text
        assert "lower_precision_safe_modules[2]" in text
        assert "no_such_package" in text


class TestPipeline(DistributedTest):
    world_size = 2

    def test_stages_run_under_autocast(self) -> None:
        # 2 stages, 4 micro-batches a batch: each micro-batch's forward under autocast, as the
        # reference's pieces of the batch are
        cfg = pipe_config(torch_autocast=BF16)
        engine = pipe_initialize(pipeline(2), cfg)
        data = global_batches(4, cfg["train_micro_batch_size_per_gpu"] * 4)
        reference = WithLoss(PipeReference())
        expected = _autocast_losses(reference, data, torch.bfloat16, world=4)
        torch.testing.assert_close(pipe_train(engine, data), expected, rtol=1e-5, atol=0)
        marked = [p for p in engine.module.parameters() if zengine.has_comm_dtype(p)]
        assert marked
        assert all(p.comm_dtype == torch.bfloat16 for p in marked)
        engine.destroy()


def test_the_section_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"torch_autocast\.dtype: expected 'fp16' or 'bf16'"):
        zengine.load_config(
            {"train_batch_size": 1, "torch_autocast": {"dtype": "fp32"}}, world_size=1
        )
    cfg = zengine.load_config(
        {"train_batch_size": 1, "torch_autocast": {"enabled": 1, "dtype": "torch.float16"}},
        world_size=1,
    )
    assert cfg.torch_autocast.enabled
    assert cfg.torch_autocast.dtype == "fp16"


class TestStage3Gathers(DistributedTest):
    @pytest.mark.parametrize("world_size", [2, 4])
    def test_linear_weights_gathered_in_bf16_compute_as_autocast_does(
        self, world_size: int
    ) -> None:
        # Linear weights all-gathered in bf16 (half the bytes) hold the values autocast casts
        # them to: the forward is bit-exact; read outside a pass they are exact fp32
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
        cfg = engine_config(3, torch_autocast=BF16, zero_optimization=zero)
        engine, *_ = zengine.initialize(model=model, config=cfg)
        narrow = [p for p in model.parameters() if zengine.has_comm_dtype(p)]
        assert narrow
        assert all(p.ds_unit.wire_bytes is not None for p in narrow)
        tokens = global_batches(1, 2 * world_size)[0]
        piece = tokens.view(world_size, -1, tokens.shape[-1])[zcomm.get_rank()]
        loss = engine(piece)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = reference(piece)
        assert torch.equal(loss, expected)
        engine.backward(loss)
        with zengine.zero.GatheredParameters(list(model.parameters())):
            for name, p in model.named_parameters():
                assert torch.equal(p, reference.get_parameter(name)), name
        engine.step()
        engine.destroy()
