"""zengine.ops: DeepSpeed's FusedAdam, DeepSpeedCPUAdam and DeepSpeedCPUAdagrad, alone and as
the optimizer the engine is given."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import zengine
from zcomm.testing import DistributedTest
from zengine.ops.adagrad import DeepSpeedCPUAdagrad
from zengine.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zengine.ops.lion import DeepSpeedCPULion, FusedLion

from ._helpers import LR, TinyGPT, engine_config, global_batches, plain_losses, train_engine


def _steps(make: Callable[[list[torch.nn.Parameter]], Any], steps: int = 5) -> torch.Tensor:
    """The parameter after `steps` steps of the optimizer `make` builds, on fixed gradients."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    grads = [torch.randn(64) for _ in range(steps)]
    opt = make([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _uncorrected(decoupled: bool, lr: float, decay: float) -> Callable[[list[Any]], Any]:
    """Adam without bias correction, written out: m / (sqrt(v) + eps)."""

    class Plain:
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            self.p = params[0]
            self.m = torch.zeros_like(self.p)
            self.v = torch.zeros_like(self.p)

        def step(self) -> None:
            p, g = self.p.data, self.p.grad
            assert g is not None
            if decoupled:
                p.mul_(1 - lr * decay)
            else:
                g = g + decay * p
            self.m.mul_(0.9).add_(g, alpha=0.1)
            self.v.mul_(0.999).addcmul_(g, g, value=0.001)
            p.sub_(lr * self.m / (self.v.sqrt() + 1e-8))

    return Plain


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_modes_are_torch_adam_and_adamw(cls: Any, decoupled: bool) -> None:
    mode = {"adam_w_mode" if cls is FusedAdam else "adamw_mode": decoupled}
    ours = _steps(lambda ps: cls(ps, lr=0.01, weight_decay=0.1, **mode))
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    theirs = _steps(lambda ps: torch_cls(ps, lr=0.01, weight_decay=0.1))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("decoupled", [True, False])
def test_without_bias_correction(decoupled: bool) -> None:
    ours = _steps(
        lambda ps: FusedAdam(
            ps, lr=0.01, weight_decay=0.1, bias_correction=False, adam_w_mode=decoupled
        )
    )
    torch.testing.assert_close(
        ours, _steps(_uncorrected(decoupled, 0.01, 0.1)), rtol=1e-5, atol=1e-6
    )
    corrected = _steps(lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.1, adam_w_mode=decoupled))
    assert not torch.allclose(ours, corrected)


def test_amsgrad_and_adagrad() -> None:
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
    ours = _steps(lambda ps: DeepSpeedCPUAdam(ps, lr=0.01, amsgrad=True, adamw_mode=False))
    theirs = _steps(lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    ours = _steps(lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1, weight_decay=0.01))
    theirs = _steps(lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=1e-10, weight_decay=0.01))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


class TestAsTheEnginesOptimizer(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize(
        ("stage", "offload", "cls"),
        [(0, False, FusedAdam), (1, True, DeepSpeedCPUAdam), (3, False, FusedAdam)],
    )
    def test_losses_follow_plain_pytorch(
        self, world_size: int, stage: int, offload: bool, cls: Any
    ) -> None:
        # what OpenRLHF and DeepSpeed-Chat do: DeepSpeedCPUAdam with offload, else FusedAdam
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        zero: dict[str, Any] = {"stage": stage}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        cfg = engine_config(stage, zero_optimization=zero)
        del cfg["optimizer"]
        optimizer = cls(model.parameters(), lr=LR, weight_decay=0.01)
        engine, returned, *_ = zengine.initialize(model=model, optimizer=optimizer, config=cfg)
        assert returned.optimizer is optimizer  # the engine steps the masters with it
        data = global_batches(4, 2 * world_size)
        expected = plain_losses(reference, data, lr=LR)
        torch.testing.assert_close(train_engine(engine, data), expected, rtol=1e-5, atol=0)
        engine.destroy()


def _lion_written_out(lr: float, decay: float) -> Callable[[list[Any]], Any]:
    """Lion as the paper writes it: p (1 - lr wd) - lr sign(b1 m + (1 - b1) g)."""

    class Plain:
        def __init__(self, params: list[torch.nn.Parameter]) -> None:
            self.p = params[0]
            self.m = torch.zeros_like(self.p)

        def step(self) -> None:
            g = self.p.grad
            assert g is not None
            c = 0.9 * self.m + 0.1 * g
            self.p.data = self.p.data * (1 - lr * decay) - lr * torch.sign(c)
            self.m = 0.999 * self.m + 0.001 * g

    return Plain


@pytest.mark.parametrize("cls", [FusedLion, DeepSpeedCPULion])
def test_lion_is_the_papers(cls: Any) -> None:
    ours = _steps(lambda ps: cls(ps, lr=0.01, weight_decay=0.1))
    torch.testing.assert_close(ours, _steps(_lion_written_out(0.01, 0.1)), rtol=1e-6, atol=1e-7)
    # a zero update leaves the parameter where it is (DeepSpeed's kernel adds lr there)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.zeros(3)
    cls([p], lr=0.5).step()
    assert torch.equal(p.detach(), torch.ones(3))


class TestLionFromTheConfig(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize("stage", [0, 2, 3])
    def test_losses_follow_plain_lion(self, world_size: int, stage: int) -> None:
        # "type": "Lion" builds FusedLion; elementwise, it steps flat partitions as it steps
        # the parameters
        torch.manual_seed(0)
        model = TinyGPT()
        reference = copy.deepcopy(model)
        cfg = engine_config(
            stage, optimizer={"type": "lion", "params": {"lr": 1e-3, "weight_decay": 0.1}}
        )
        engine, optimizer, *_ = zengine.initialize(model=model, config=cfg)
        assert isinstance(optimizer.optimizer, FusedLion)
        data = global_batches(4, 2 * world_size)
        opt = FusedLion(reference.parameters(), lr=1e-3, weight_decay=0.1)
        expected = []
        for tokens in data:
            loss = reference(tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            expected.append(loss.item())
        torch.testing.assert_close(train_engine(engine, data), expected, rtol=1e-5, atol=0)
        engine.destroy()


def test_an_optimizer_of_matrices_is_refused_by_name() -> None:
    # the engine steps flat partitions: Muon would fail at its first step, mid-training
    model = torch.nn.Linear(4, 4, bias=False)
    muon = torch.optim.Muon(model.parameters())
    with pytest.raises(ValueError, match="Muon updates each parameter as a matrix"):
        zengine.initialize(model=model, optimizer=muon, config={"train_batch_size": 1})
