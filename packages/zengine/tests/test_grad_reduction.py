"""DeepSpeed's reduction options (``gradient_allreduce_op``, ``prescale_gradients``,
``gradient_predivide_factor``) at ZeRO stages 0-3: against the reduction done by hand in the same
order and dtypes ([Note: gradient reduction]), and against plain PyTorch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
from zcomm.testing import DistributedTest

from ._helpers import SCALE_SIZES as SIZES
from ._helpers import Scale as _Scale
from ._helpers import TinyGPT, global_batches

STAGES = pytest.mark.parametrize("stage", [0, 1, 2, 3])
# each option, and the factors it puts around the sum of W ranks' gradients
OPTIONS: dict[str, dict[str, Any]] = {
    "mean": {},
    "sum": {"gradient_allreduce_op": "sum"},
    "predivide": {"gradient_predivide_factor": 2.0},
    "prescale": {"prescale_gradients": True},
}


def _config(stage: int, dtype: str, accumulation: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulation,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **({"bf16": {"enabled": True}} if dtype == "bf16" else {}),
        **extra,
    }


def _input(rank: int, micro: int) -> torch.Tensor:
    """Small whole numbers: every sum and power-of-two division below is exact in bf16."""
    return (torch.arange(sum(SIZES)) % 5 + 1 + rank + micro).float()


def _grads(engine: zengine.Engine) -> torch.Tensor:
    """The reduced gradient of every parameter, whole, in fp32, laid end to end."""
    full = [zengine.safe_get_full_grad(p) for p in engine.module.parameters()]
    return torch.cat([g.reshape(-1).float() for g in full if g is not None])


def _tagged(option: str) -> Callable[[str], str]:
    """A failure message that names the option."""
    return lambda message: f"{option}: {message}"


def _params(engine: zengine.Engine) -> torch.Tensor:
    full = [zengine.safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    return torch.cat([p.reshape(-1) for p in full if p is not None])


class TestAgainstTheHandReduction(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @STAGES
    @pytest.mark.parametrize("dtype", ["fp32", "bf16"])
    def test_sum_mean_and_their_divisions_with_accumulation(
        self, world_size: int, stage: int, dtype: str
    ) -> None:
        # 2 micro-batches: each rank's gradient is its mean over them (the loss divided by the
        # accumulation steps), then the ranks' are summed, or averaged in any of three orders
        rank, accumulation = zcomm.get_rank(), 2
        total = sum(
            sum(_input(r, k) for k in range(accumulation)) / accumulation for r in range(world_size)
        )
        model_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        for name, option in OPTIONS.items():
            model = _Scale()
            cfg = _config(stage, dtype, accumulation, **option)
            engine, *_ = zengine.initialize(model=model, config=cfg)
            for k in range(accumulation):
                engine.backward(engine(_input(rank, k).to(model_dtype)))
                if k < accumulation - 1:
                    engine.step()  # counts the micro-step; the boundary's step comes below
            expected = total if name == "sum" else total / world_size
            torch.testing.assert_close(_grads(engine), expected, rtol=0, atol=0, msg=_tagged(name))
            engine.step()  # SGD with lr 1 from zeros: the parameters are minus the gradient
            torch.testing.assert_close(
                _params(engine), -expected, rtol=0, atol=0, msg=_tagged(name)
            )
            engine.destroy()

    @pytest.mark.parametrize("world_size", [2])
    @STAGES
    def test_the_division_order_and_dtype_are_deepspeeds(self, world_size: int, stage: int) -> None:
        # a pre-divide factor of 3 rounds: g/3 in the reduction's dtype, summed, times 3/W
        # there, then into the gradient partition's dtype; another order rounds otherwise
        grads = [
            torch.tensor([1.0, 5, 7, 11, 13, 17, 19, 23, 2, 4, 6, 8, 10, 12, 14]),
            torch.tensor([2.0, 7, 13, 3, 29, 31, 37, 41, 1, 3, 5, 7, 9, 11, 13]),
        ]
        rank = zcomm.get_rank()
        setups = [  # (model dtype, communication_data_type)
            (torch.bfloat16, None),
            (torch.bfloat16, "fp32"),
            (torch.float32, None),
        ]
        for model_dtype, comm in setups:
            extra: dict[str, Any] = {"gradient_predivide_factor": 3.0}
            if comm is not None:
                extra["communication_data_type"] = comm
            dtype = "bf16" if model_dtype == torch.bfloat16 else "fp32"
            engine, *_ = zengine.initialize(model=_Scale(), config=_config(stage, dtype, **extra))
            engine.backward(engine(grads[rank].to(model_dtype)))
            reduce_in = torch.float32 if comm == "fp32" else model_dtype
            scaled = [g.to(model_dtype).to(reduce_in) * (1 / 3) for g in grads]
            reduced = (scaled[0] + scaled[1]) * (3 / world_size)
            # stage 3 accumulates in the compute dtype (DeepSpeed's default), 0-2 in fp32
            kept = model_dtype if stage == 3 else torch.float32
            expected = reduced.to(kept).float()
            torch.testing.assert_close(_grads(engine), expected, rtol=0, atol=0)
            if model_dtype == torch.bfloat16 and comm is None:
                mean = ((grads[0] + grads[1]).to(model_dtype) / world_size).float()
                assert not torch.equal(expected, mean)  # the order shows
            engine.destroy()


def _train(engine: zengine.Engine, data: list[torch.Tensor]) -> list[float]:
    """Each global batch split over 2 accumulation steps and the ranks; the mean losses."""
    rank, world = zcomm.get_rank(), zcomm.get_world_size()
    losses = []
    for tokens in data:
        pieces = tokens.view(2, world, -1, tokens.shape[-1])
        total = torch.zeros(())
        for k in range(2):
            loss = engine(pieces[k, rank])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG)
        losses.append(total.item() / 2)
    return losses


def _plain(model: nn.Module, data: list[torch.Tensor], lr: float, times: float) -> list[float]:
    """Plain PyTorch, one process: the global batch's mean loss, its gradient times `times`
    (the data-parallel size for "sum": the sum of the ranks' means)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for tokens in data:
        loss = model(tokens)
        (loss * times).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class TestAgainstPlainPyTorch(DistributedTest):
    @pytest.mark.parametrize("world_size", [2, 4])
    @STAGES
    def test_losses(self, world_size: int, stage: int) -> None:
        lr = 0.05
        data = global_batches(3, 2 * world_size)
        for name, option in OPTIONS.items():
            torch.manual_seed(0)
            model = TinyGPT(blocks=1)
            reference = copy.deepcopy(model)
            cfg = _config(stage, "fp32", 2, **option)
            cfg["optimizer"]["params"]["lr"] = lr
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 16
            engine, *_ = zengine.initialize(model=model, config=cfg)
            times = float(world_size) if name == "sum" else 1.0
            expected = _plain(reference, data, lr, times)
            torch.testing.assert_close(
                _train(engine, data), expected, rtol=1e-5, atol=0, msg=_tagged(name)
            )
            engine.destroy()


class TestEngineAccessors(DistributedTest):
    @pytest.mark.parametrize("world_size", [1])
    def test_deepspeeds_names(self, world_size: int) -> None:
        cfg = _config(1, "fp32", gradient_allreduce_op="SUM", gradient_predivide_factor=4.0)
        engine, *_ = zengine.initialize(model=_Scale(), config=cfg)
        assert engine.gradient_average is False
        assert engine.postscale_gradients() is True
        assert engine.gradient_predivide_factor() == 4.0
        engine.destroy()


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        (
            {"gradient_allreduce_op": "max"},
            "gradient_allreduce_op: Invalid gradient_allreduce_op 'max': expected 'mean' or 'sum'",
        ),
        ({"gradient_predivide_factor": 0}, "gradient_predivide_factor: must be > 0, got 0"),
        ({"gradient_predivide_factor": True}, "gradient_predivide_factor: expected a number"),
        ({"prescale_gradients": "yes"}, "prescale_gradients: expected true or false"),
    ],
)
def test_a_bad_value_names_its_key(given: dict[str, Any], problem: str) -> None:
    with pytest.raises(zengine.ConfigError, match=problem):
        zengine.load_config({"train_batch_size": 1, **given}, world_size=1)


def test_the_options_read_as_deepspeeds() -> None:
    config = zengine.load_config(
        {"train_batch_size": 4, "gradient_allreduce_op": "Sum", "prescale_gradients": 1},
        world_size=4,
    )
    assert config.gradient_allreduce_op == "sum"
    reduction = config.gradient_reduction
    assert reduction.factors(4) == (1.0, 1.0)  # a sum: prescale_gradients is not read
    assert reduction.factors(1) is None  # one rank: nothing to reduce or scale
    predivide = zengine.load_config(
        {"train_batch_size": 4, "gradient_predivide_factor": 8}, world_size=4
    ).gradient_reduction
    assert predivide.factors(4) == (1 / 8, 2.0)
    both = zengine.load_config(
        {"train_batch_size": 4, "gradient_predivide_factor": 8, "prescale_gradients": True},
        world_size=4,
    ).gradient_reduction
    assert both.factors(4) == (1 / 4, 1.0)  # prescaling wins, as in DeepSpeed
    assert zengine.load_config({"train_batch_size": 1}, world_size=1).gradient_reduction.is_mean


def test_muon_is_refused_by_name() -> None:
    with pytest.raises(zengine.ConfigError, match=r"optimizer.type: 'Muon' updates each param"):
        zengine.load_config(
            {"train_batch_size": 1, "optimizer": {"type": "Muon", "params": {}}}, world_size=1
        )
