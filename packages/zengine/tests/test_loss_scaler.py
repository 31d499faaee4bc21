"""Loss scalers: the scale after each step of overflow sequences, worked out by hand (and
checked against DeepSpeed 0.19.8's DynamicLossScaler, which gives the same sequences)."""

from __future__ import annotations

import pytest
import torch

from zengine._optim import (
    DynamicLossScaler,
    MinLossScaleError,
    StaticLossScaler,
)

T, F = True, False  # overflow, clean step


def _run(scaler, steps):
    """The scale after each update_scale(step)."""
    scales = []
    for overflow in steps:
        scaler.update_scale(overflow)
        scales.append(scaler.loss_scale)
    return scales


# --- dynamic scale ----------------------------------------------------------------------------


def test_defaults():
    scaler = DynamicLossScaler()
    assert scaler.loss_scale == 2.0**16
    assert scaler.dynamic
    assert (scaler.scale_factor, scaler.scale_window, scaler.min_scale) == (2.0, 1000, 1.0)
    assert scaler.delayed_shift == 1


def test_raise_after_each_clean_window():
    # DeepSpeed's rule: (cur_iter - last_overflow_iter - 1) % window == 0, the step right
    # after an overflow (or the first step) not counted: the first raise at the fourth step.
    scaler = DynamicLossScaler(init_scale=16, scale_window=3)
    assert _run(scaler, [F, F, F, F, F, F, F]) == [16, 16, 16, 32, 32, 32, 64]
    assert _run(scaler, [T, F, F, F, F]) == [32, 32, 32, 32, 64]
    assert _run(scaler, [T, T, F]) == [32, 16, 16]


def test_overflow_lowers_and_restarts_the_window():
    scaler = DynamicLossScaler(init_scale=16, scale_window=3)
    assert _run(scaler, [F, F, T, F, F, F, F]) == [16, 16, 8, 8, 8, 8, 16]
    assert scaler.last_overflow_iter == 2
    assert scaler.cur_iter == 7


def test_scale_factor():
    scaler = DynamicLossScaler(init_scale=81, scale_factor=3, scale_window=2)
    assert _run(scaler, [T, T, F, F, F]) == [27, 9, 9, 9, 27]


def test_hysteresis_delays_the_first_lowering_only():
    # delayed_shift=2: the first overflow spends the hysteresis; lowering does not refill it,
    # and neither does a clean step short of a raise (DeepSpeed's rules).
    scaler = DynamicLossScaler(init_scale=16, scale_window=100, delayed_shift=2)
    assert _run(scaler, [T]) == [16]
    assert scaler.cur_hysteresis == 1
    assert _run(scaler, [T, T, F, T]) == [8, 4, 4, 2]
    assert scaler.cur_hysteresis == 1


def test_hysteresis_is_refilled_by_a_raise():
    scaler = DynamicLossScaler(init_scale=16, scale_window=2, delayed_shift=2)
    # iter 0 overflow (hysteresis 2 -> 1), iters 1-3 clean: raise at (3 - 0 - 1) % 2 == 0
    # refills.
    assert _run(scaler, [T, F, F, F]) == [16, 16, 16, 32]
    assert scaler.cur_hysteresis == 2
    assert _run(scaler, [T, T]) == [32, 16]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    scaler = DynamicLossScaler(
        init_scale=16, scale_window=100, delayed_shift=2, consecutive_hysteresis=True
    )
    assert _run(scaler, [T, F, T, F, T, T, T]) == [16, 16, 16, 16, 16, 8, 4]
    plain = DynamicLossScaler(init_scale=16, scale_window=100, delayed_shift=2)
    assert _run(plain, [T, F, T, F, T, T, T]) == [16, 16, 8, 8, 4, 2, 1]


def test_consecutive_hysteresis_still_raises_after_a_window():
    scaler = DynamicLossScaler(
        init_scale=4, scale_window=2, delayed_shift=3, consecutive_hysteresis=True
    )
    assert _run(scaler, [F, F, F, T, T, F, F, F]) == [4, 4, 8, 8, 8, 8, 8, 16]
    assert scaler.cur_hysteresis == 3


def test_min_scale_error():
    scaler = DynamicLossScaler(init_scale=4, min_scale=1)
    assert _run(scaler, [T, T]) == [2, 1]
    with pytest.raises(MinLossScaleError, match="minimum"):
        scaler.update_scale(True)
    assert scaler.loss_scale == 1


def test_min_scale_is_a_floor_not_a_power_of_the_factor():
    scaler = DynamicLossScaler(init_scale=3, min_scale=2)
    assert _run(scaler, [T]) == [2]
    with pytest.raises(MinLossScaleError):
        scaler.update_scale(True)


def test_min_scale_without_error_keeps_training():
    scaler = DynamicLossScaler(init_scale=2, min_scale=1, raise_error_at_min_scale=False)
    assert _run(scaler, [T, T, T]) == [1, 1, 1]


def test_min_scale_with_hysteresis_spends_the_hysteresis_first():
    scaler = DynamicLossScaler(init_scale=1, min_scale=1, delayed_shift=2)
    assert _run(scaler, [T]) == [1]
    with pytest.raises(MinLossScaleError):
        scaler.update_scale(True)


def test_state_dict_round_trip():
    steps = [T, F, F, T, F, F, F, T, F, F, F, F]
    first = DynamicLossScaler(init_scale=64, scale_window=3, delayed_shift=2)
    _run(first, steps[:5])
    second = DynamicLossScaler(init_scale=64, scale_window=3, delayed_shift=2)
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == first.state_dict()
    assert _run(second, steps[5:]) == _run(first, steps[5:])

    with pytest.raises(ValueError, match="cur_hysteresis"):
        second.load_state_dict({"cur_scale": 1.0, "cur_iter": 0, "last_overflow_iter": -1})


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"init_scale": 0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"scale_factor": 1.0}, "scale_factor"),
        ({"scale_window": 0}, "scale_window"),
        ({"min_scale": -1}, "min_scale"),
        ({"delayed_shift": 0}, "delayed_shift"),
    ],
)
def test_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kw)


# --- static scale -----------------------------------------------------------------------------


def test_static_never_changes():
    scaler = StaticLossScaler(128.0)
    assert not scaler.dynamic
    assert _run(scaler, [T, T, T, F, F, T] + [F] * 2000) == [128.0] * 2006
    state = scaler.state_dict()
    assert state == {"cur_scale": 128.0}
    other = StaticLossScaler(1.0)
    other.load_state_dict(state)
    assert other.loss_scale == 128.0
    with pytest.raises(ValueError, match="scale"):
        StaticLossScaler(0.0)


def test_scale_loss():
    loss = torch.tensor(1.5, requires_grad=True)
    scaled = DynamicLossScaler(init_scale=8).scale_loss(loss)
    assert scaled.item() == 12.0
    scaled.backward()
    assert loss.grad is not None
    assert loss.grad.item() == 8.0
    assert StaticLossScaler(4).scale_loss(torch.tensor(2.0)).item() == 8.0


# --- overflow check ---------------------------------------------------------------------------


@pytest.mark.parametrize("scaler", [DynamicLossScaler(), StaticLossScaler(1.0)])
def test_has_overflow(scaler):
    fine = [torch.ones(3), torch.zeros(2, 2, dtype=torch.float16), None, torch.empty(0)]
    assert not scaler.has_overflow(fine)
    assert not scaler.has_overflow([])
    assert scaler.has_overflow([*fine, torch.tensor([1.0, float("inf")])])
    assert scaler.has_overflow([torch.tensor([float("-inf")]), *fine])
    assert scaler.has_overflow([torch.ones(2), torch.tensor([[0.0, float("nan")]])])
    assert scaler.has_overflow(iter([torch.tensor([float("nan")], dtype=torch.bfloat16)]))


def test_has_overflow_large_but_finite_half():
    # The sum of these overflows fp16; the values themselves do not.
    big = torch.full((8,), 60000.0, dtype=torch.float16)
    assert not DynamicLossScaler().has_overflow([big, -big])


def test_has_overflow_reads_back_once_per_device(monkeypatch):
    reads = []
    original = torch.Tensor.__bool__

    def counting_bool(self):
        reads.append(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", counting_bool)
    grads = [torch.ones(4) for _ in range(50)]
    assert not DynamicLossScaler().has_overflow(grads)
    assert len(reads) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_has_overflow_across_devices():
    scaler = DynamicLossScaler()
    gpu = [torch.ones(1000, device="cuda", dtype=torch.float16) for _ in range(10)]
    cpu = [torch.ones(10)]
    assert not scaler.has_overflow(gpu + cpu)
    bad = torch.ones(10, device="cuda")
    bad[3] = float("inf")
    assert scaler.has_overflow([*cpu, *gpu, bad])
    assert scaler.has_overflow([*gpu, torch.tensor([float("nan")])])
