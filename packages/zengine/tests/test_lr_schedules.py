"""DeepSpeed's schedules against values worked out by hand from DeepSpeed's formulas."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from zengine._optim._lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    WarmupScheduler,
    build_scheduler,
)


def _sgd(*lrs: float) -> torch.optim.SGD:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def _lrs_at(schedule: WarmupScheduler, steps: list[int]) -> dict[int, list[float]]:
    """Call step() once per step up to max(steps); record the optimizer's lrs at `steps`."""
    seen: dict[int, list[float]] = {}
    for i in range(max(steps) + 1):
        schedule.step()
        assert schedule.last_batch_iteration == i
        if i in steps:
            seen[i] = [g["lr"] for g in schedule.optimizer.param_groups]
            assert schedule.get_last_lr() == seen[i]
    return seen


# --- WarmupLR ---------------------------------------------------------------------------------


def test_warmup_lr_log():
    opt = _sgd(1.0)
    schedule = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10)
    # Built from scratch, the optimizer starts at min_lr (not at its own 1.0).
    assert opt.param_groups[0]["lr"] == 0.0
    assert schedule.get_last_lr() == [0.0]
    seen = _lrs_at(schedule, [0, 4, 9, 10, 50])
    assert seen[0] == [0.0]  # log(1) / log(10)
    assert seen[4] == [pytest.approx(0.0698970004)]  # 0.1 * log(5) / log(10)
    assert seen[9] == [pytest.approx(0.1)]  # log(10) / log(10): full lr one step early
    assert seen[10] == [0.1]
    assert seen[50] == [0.1]


def test_warmup_lr_linear():
    schedule = WarmupLR(
        _sgd(1.0),
        warmup_min_lr=0.02,
        warmup_max_lr=0.12,
        warmup_num_steps=10,
        warmup_type="linear",
    )
    seen = _lrs_at(schedule, [0, 5, 9, 10, 11])
    assert seen[0] == [pytest.approx(0.02)]
    assert seen[5] == [pytest.approx(0.07)]  # 0.02 + 0.1 * 5/10
    assert seen[9] == [pytest.approx(0.11)]  # linear reaches max only at step W
    assert seen[10] == [pytest.approx(0.12)]
    assert seen[11] == [pytest.approx(0.12)]


def test_warmup_lr_per_group_values():
    opt = _sgd(1.0, 1.0)
    schedule = WarmupLR(
        opt,
        warmup_min_lr=[0.0, 0.01],
        warmup_max_lr=(0.1, 0.21),
        warmup_num_steps=4,
        warmup_type="linear",
    )
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.01]
    seen = _lrs_at(schedule, [2, 4])
    assert seen[2] == [pytest.approx(0.05), pytest.approx(0.11)]
    assert seen[4] == [pytest.approx(0.1), pytest.approx(0.21)]


def test_warmup_lr_scalar_applies_to_every_group():
    opt = _sgd(1.0, 2.0, 3.0)
    schedule = WarmupLR(opt, warmup_max_lr=0.3, warmup_num_steps=3, warmup_type="linear")
    assert _lrs_at(schedule, [3])[3] == [0.3, 0.3, 0.3]


def test_warmup_steps_below_two_are_raised_to_two():
    # DeepSpeed's rule: log(1) would divide by zero.
    schedule = WarmupLR(_sgd(1.0), warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert schedule.warmup_num_steps == 2
    seen = _lrs_at(schedule, [0, 1, 2])
    assert seen == {0: [0.0], 1: [0.5], 2: [1.0]}


def test_warmup_lr_peaks_at_each_groups_own_lr_when_no_max_is_given():
    # DeepSpeed 0.19's default: warmup_max_lr None is the optimizer's lr of each group
    opt = _sgd(0.1, 0.2)
    schedule = WarmupLR(opt, warmup_num_steps=10)
    assert schedule.max_lrs == [0.1, 0.2]
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    schedule.step(10)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]
    # WarmupDecayLR keeps DeepSpeed's fixed default
    assert WarmupDecayLR(_sgd(0.5), 20, warmup_num_steps=10).max_lrs == [0.001]


def test_explicit_step_index():
    schedule = WarmupLR(_sgd(1.0), warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    schedule.step(7)
    assert schedule.last_batch_iteration == 7
    assert schedule.get_last_lr() == [pytest.approx(0.07)]
    schedule.step()
    assert schedule.get_last_lr() == [pytest.approx(0.08)]


# --- WarmupDecayLR ----------------------------------------------------------------------------


def test_warmup_decay_lr_linear():
    schedule = WarmupDecayLR(
        _sgd(1.0),
        total_num_steps=30,
        warmup_min_lr=0.0,
        warmup_max_lr=0.1,
        warmup_num_steps=10,
        warmup_type="linear",
    )
    seen = _lrs_at(schedule, [0, 5, 10, 20, 29, 30, 35])
    assert seen[0] == [0.0]
    assert seen[5] == [pytest.approx(0.05)]
    assert seen[10] == [pytest.approx(0.1)]  # (30 - 10) / (30 - 10)
    assert seen[20] == [pytest.approx(0.05)]  # (30 - 20) / 20
    assert seen[29] == [pytest.approx(0.005)]  # (30 - 29) / 20
    assert seen[30] == [0.0]
    assert seen[35] == [0.0]  # clamped, never negative


def test_warmup_decay_lr_log_warmup_then_decay_from_max():
    schedule = WarmupDecayLR(
        _sgd(1.0), total_num_steps=20, warmup_min_lr=0.01, warmup_max_lr=0.11, warmup_num_steps=5
    )
    seen = _lrs_at(schedule, [1, 4, 5, 15])
    assert seen[1] == [pytest.approx(0.0530676558)]  # 0.01 + 0.1 * log(2) / log(5)
    assert seen[4] == [pytest.approx(0.11)]
    assert seen[5] == [pytest.approx(0.11)]  # decay: min + delta * (20 - 5) / 15
    assert seen[15] == [pytest.approx(0.0433333333)]  # 0.01 + 0.1 * 5 / 15


def test_warmup_decay_lr_total_equal_to_warmup():
    schedule = WarmupDecayLR(
        _sgd(1.0), total_num_steps=4, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear"
    )
    seen = _lrs_at(schedule, [3, 4, 5])
    assert seen == {3: [pytest.approx(0.075)], 4: [0.0], 5: [0.0]}


# --- WarmupCosineLR ---------------------------------------------------------------------------


def _cosine(**kw):
    opt = _sgd(0.2, 0.02)
    args: dict[str, Any] = {
        "total_num_steps": 20,
        "warmup_min_ratio": 0.1,
        "warmup_num_steps": 10,
        "cos_min_ratio": 0.01,
        "warmup_type": "linear",
    }
    args.update(kw)
    return opt, WarmupCosineLR(opt, **args)


def test_warmup_cosine_lr_linear():
    opt, schedule = _cosine()
    # Before the first step DeepSpeed sets every lr to 0; the peaks were read before that.
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    assert schedule.org_lrs == [0.2, 0.02]
    seen = _lrs_at(schedule, [0, 5, 9, 10, 14, 19, 20])
    assert seen[0] == [pytest.approx(0.02), pytest.approx(0.002)]  # ratio 0.1
    assert seen[5] == [pytest.approx(0.11), pytest.approx(0.011)]  # 0.1 + 0.9 * 0.5
    assert seen[9] == [pytest.approx(0.182), pytest.approx(0.0182)]  # 0.1 + 0.9 * 0.9
    # Cosine step 1 of 10: 0.01 + 0.99 * (1 + cos(pi / 10)) / 2 = 0.9757729...
    assert seen[10] == [pytest.approx(0.1951546), pytest.approx(0.01951546)]
    assert seen[14] == [pytest.approx(0.101), pytest.approx(0.0101)]  # half way: 0.505
    assert seen[19] == [pytest.approx(0.002), pytest.approx(0.0002)]  # cos(pi): cos_min_ratio
    # Past the end the cosine turns back up, as in DeepSpeed: 0.01 + 0.99 * 0.0244717 = 0.0342270
    assert seen[20] == [pytest.approx(0.00684540), pytest.approx(0.000684540)]


def test_warmup_cosine_lr_log():
    _, schedule = _cosine(warmup_type="log", warmup_min_ratio=0.0)
    seen = _lrs_at(schedule, [0, 3, 9])
    assert seen[0] == [0.0, 0.0]
    assert seen[3] == [pytest.approx(0.1204119983), pytest.approx(0.01204119983)]  # log 4/log 10
    assert seen[9] == [pytest.approx(0.2), pytest.approx(0.02)]
    assert schedule.get_lr_ratio() == pytest.approx(1.0)


def test_warmup_cosine_lr_total_equal_to_warmup_stays_at_min():
    _, schedule = _cosine(total_num_steps=10)
    seen = _lrs_at(schedule, [10, 11])
    assert seen[10] == [pytest.approx(0.002), pytest.approx(0.0002)]
    assert seen[11] == seen[10]


# --- state ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (WarmupLR, {"warmup_max_lr": 0.1, "warmup_num_steps": 10}),
        (WarmupDecayLR, {"total_num_steps": 30, "warmup_max_lr": 0.1, "warmup_num_steps": 10}),
        (WarmupCosineLR, {"total_num_steps": 30, "warmup_num_steps": 10}),
    ],
)
def test_state_dict_round_trip(cls, kw):
    first = cls(_sgd(0.3, 0.03), **kw)
    for _ in range(17):
        first.step()
    sd = first.state_dict()
    assert sd == {"last_batch_iteration": 16}

    second = cls(_sgd(0.3, 0.03), **kw)
    second.load_state_dict(sd)
    assert second.last_batch_iteration == 16
    for _ in range(5):
        first.step()
        second.step()
        assert second.get_last_lr() == first.get_last_lr()
        assert [g["lr"] for g in second.optimizer.param_groups] == first.get_last_lr()


def test_resume_with_last_batch_iteration_leaves_optimizer_alone():
    opt = _sgd(0.5)
    schedule = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=10, last_batch_iteration=4)
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(RuntimeError, match="step"):
        schedule.get_last_lr()
    schedule.step()
    assert schedule.last_batch_iteration == 5
    assert schedule.get_last_lr() == [pytest.approx(0.1 * 0.7781512504)]  # log(6) / log(10)


# --- bad arguments ----------------------------------------------------------------------------


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(_sgd(1.0), warmup_num_steps=-1)
    with pytest.raises(ValueError, match=r"WarmupCosineLR\(warmup_num_steps=...\): must be >= 1"):
        WarmupCosineLR(_sgd(1.0), 100, warmup_num_steps=0)
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupDecayLR(_sgd(1.0), 100, warmup_num_steps=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(_sgd(1.0), warmup_type="cosine")
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupCosineLR(_sgd(1.0), 100, warmup_type="exp")
    with pytest.raises(ValueError, match="total_num_steps"):
        WarmupDecayLR(_sgd(1.0), total_num_steps=5, warmup_num_steps=10)
    with pytest.raises(ValueError, match="total_num_steps"):
        WarmupCosineLR(_sgd(1.0), total_num_steps=5, warmup_num_steps=10)
    with pytest.raises(ValueError, match="warmup_min_lr"):
        WarmupLR(_sgd(1.0, 1.0), warmup_min_lr=[0.0])
    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())  # type: ignore[arg-type]


# --- LRRangeTest ------------------------------------------------------------------------------


def test_lr_range_test_continuous_and_staircase():
    # lr(i) = min_lr * (1 + rate * (i + 1) / size), the quotient floored in staircase mode
    opt = _sgd(1.0)
    schedule = LRRangeTest(
        opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=0.5
    )
    assert opt.param_groups[0]["lr"] == 0.01  # before the first step
    seen = _lrs_at(schedule, [0, 2, 7])
    assert seen[0] == [pytest.approx(0.01 * (1 + 0.5 * 1 / 4))]
    assert seen[2] == [pytest.approx(0.01 * (1 + 0.5 * 3 / 4))]
    assert seen[7] == [pytest.approx(0.01 * (1 + 0.5 * 2))]
    stairs = LRRangeTest(
        _sgd(1.0, 2.0),
        lr_range_test_min_lr=[0.01, 0.02],
        lr_range_test_step_size=4,
        lr_range_test_staircase=True,
    )
    seen = _lrs_at(stairs, [2, 3, 6, 7])
    assert seen[2] == [0.01, 0.02]  # (2 + 1) // 4 = 0: still the starting lr
    assert seen[3] == seen[6] == [pytest.approx(0.02), pytest.approx(0.04)]
    assert seen[7] == [pytest.approx(0.03), pytest.approx(0.06)]


# --- OneCycle ---------------------------------------------------------------------------------


def _adam() -> torch.optim.Adam:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0, betas=(0.9, 0.999))


def test_one_cycle_goes_up_down_then_decays_with_the_first_beta_against_it():
    # 4 steps up, 2 down: scale (i + 1) / 4 up to 1 at i = 3, then (x - 1) / (ratio - 1)
    opt = _adam()
    schedule = OneCycle(
        opt,
        cycle_min_lr=0.1,
        cycle_max_lr=0.5,
        cycle_first_step_size=4,
        cycle_second_step_size=2,
        decay_lr_rate=0.5,
        decay_step_size=2,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.1,
    )
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"]) == (0.1, (0.8, 0.99))  # before the first step
    assert schedule.get_mom() == [(0.9, 0.99)]  # DeepSpeed's formula there, not the betas
    expected = {
        0: (0.1 + 0.4 * 0.25, 0.9 - 0.1 * 0.25),
        3: (0.5, 0.8),  # the top
        4: (0.1 + 0.4 * 0.5, 0.9 - 0.1 * 0.5),  # x = 5/6: (5/6 - 1) / (2/3 - 1) = 0.5
        6: (0.1 / (1 + 0.5 * 1 / 2), 0.9 * (1 + 0.1 * 1 / 2)),  # the first step past the cycle
        9: (0.1 / (1 + 0.5 * 4 / 2), 0.9 * (1 + 0.1 * 4 / 2)),
    }
    for i in range(10):
        schedule.step()
        if i in expected:
            lr, beta = expected[i]
            assert group["lr"] == pytest.approx(lr), i
            assert group["betas"][0] == pytest.approx(beta), i
            assert group["betas"][1] == 0.99
            assert schedule.get_mom() == [group["betas"]]


def test_one_cycle_without_decay_holds_the_ends_and_skips_momentum_without_betas(caplog):
    schedule = OneCycle(_adam(), cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=2)
    lrs = _lrs_at(schedule, [5, 9])
    assert lrs[5] == lrs[9] == [0.1]  # no decay_step_size: the lr stays at cycle_min_lr
    assert schedule.get_mom() == [(0.9, 0.99)]
    with caplog.at_level("WARNING", logger="zengine"):
        sgd = OneCycle(_sgd(1.0), cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=2)
    assert "cycle_momentum is off: SGD has no betas" in caplog.text
    sgd.step()
    assert "betas" not in sgd.optimizer.param_groups[0]
    assert sgd.get_mom() is None


def test_one_cycle_resumes_where_it_was():
    first = OneCycle(_adam(), cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=3)
    _lrs_at(first, [4])
    resumed = OneCycle(
        _adam(), cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=3, last_batch_iteration=0
    )
    resumed.load_state_dict(first.state_dict())
    first.step()
    resumed.step()
    assert resumed.get_last_lr() == first.get_last_lr()
    assert resumed.optimizer.param_groups[0]["betas"] == first.optimizer.param_groups[0]["betas"]


def _one_cycle(**kw: Any) -> OneCycle:
    return OneCycle(_adam(), cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_momentum=False, **kw)


def test_one_cycle_stairs_hold_the_lr_over_each_part_of_a_half():
    # 4 up, 6 down; 2 stairs up: flat over steps 1-2 of the way up (half the height), 3 down
    schedule = _one_cycle(
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        cycle_first_stair_count=2,
        cycle_second_stair_count=3,
    )
    lrs = [lr for lrs in _lrs_at(schedule, list(range(10))).values() for lr in lrs]
    # step i has done i + 1 steps: up at 1..4 -> floor(done * 2 / 4) / 2, down at 5..10 ->
    # floor((10 - done) * 3 / 6) / 3
    assert lrs == pytest.approx([0.0, 0.5, 0.5, 1.0, 2 / 3, 2 / 3, 1 / 3, 1 / 3, 0.0, 0.0])
    assert _one_cycle(cycle_first_step_size=4, cycle_first_stair_count=4).second_stair_count == 4


def test_one_cycle_stairs_as_many_as_steps_are_the_continuous_cycle():
    # whole steps decide the stair, so an uneven cycle's top is not floored a stair down
    kw: dict[str, Any] = {"cycle_first_step_size": 10, "cycle_second_step_size": 21}
    continuous = _lrs_at(_one_cycle(**kw), list(range(31)))
    stairs = _lrs_at(
        _one_cycle(**kw, cycle_first_stair_count=10, cycle_second_stair_count=21), list(range(31))
    )
    assert stairs == {i: [pytest.approx(lr[0])] for i, lr in continuous.items()}
    assert stairs[9] == [1.0]


def test_one_cycle_takes_one_value_per_group_for_lrs_and_betas():
    opt = torch.optim.Adam(
        [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in (0.1, 0.2)]
    )
    schedule = OneCycle(
        opt,
        cycle_min_lr=[0.001, 0.002],
        cycle_max_lr=[0.01, 0.02],
        cycle_min_mom=[0.8, 0.85],
        cycle_max_mom=[0.9, 0.95],
        cycle_first_step_size=5,
    )
    assert [g["betas"][0] for g in opt.param_groups] == [0.8, 0.85]  # before the first step
    schedule.step(4)  # the top
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 0.02])
    moms = schedule.get_mom()
    assert moms is not None
    assert [beta1 for beta1, _ in moms] == pytest.approx([0.8, 0.85])
    assert [beta2 for _, beta2 in moms] == [0.99, 0.99]
    schedule.step(9)  # the end
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.9, 0.95])
    with pytest.raises(ValueError, match=r"OneCycle\(cycle_max_mom=...\).*\(2\), got 3"):
        OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=0.2, cycle_max_mom=[0.9, 0.9, 0.9])


def test_one_cycle_without_a_second_half_drops_back_at_once():
    schedule = _one_cycle(cycle_first_step_size=4, cycle_second_step_size=0)
    assert schedule.step_ratio == 1.0
    lrs = _lrs_at(schedule, [0, 2, 3, 4])
    assert lrs == {0: [0.25], 2: [0.75], 3: [0.0], 4: [0.0]}  # the cycle is 4 steps long


def test_one_cycle_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match=r"OneCycle\(cycle_first_step_size=...\): must be >= 1"):
        OneCycle(_adam(), cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=0)
    with pytest.raises(ValueError, match=r"OneCycle\(cycle_second_step_size=...\): must be >= 0"):
        _one_cycle(cycle_first_step_size=4, cycle_second_step_size=-1)
    with pytest.raises(
        ValueError, match=r"OneCycle\(cycle_first_stair_count=...\): expected an int"
    ):
        _one_cycle(cycle_first_stair_count=1.5)
    with pytest.raises(ValueError, match=r"LRRangeTest\(lr_range_test_step_size=...\)"):
        LRRangeTest(_adam(), lr_range_test_step_size=1.5)  # type: ignore[arg-type]


# --- tensor lrs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "kw", "first", "after_one"),
    [
        (LRRangeTest, {}, 1e-3, 1e-3 * (1 + 2 / 2000)),
        (
            OneCycle,
            {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10},
            0.01,
            0.01 + 0.09 * 2 / 10,
        ),
        (WarmupLR, {"warmup_num_steps": 10}, 0.0, 0.1 * math.log(2) / math.log(10)),
        (
            WarmupDecayLR,
            {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_max_lr": 0.1},
            0.0,
            0.1 * math.log(2) / math.log(10),
        ),
        (
            WarmupCosineLR,
            {"total_num_steps": 100, "warmup_num_steps": 10},
            0.0,
            0.1 * math.log(2) / math.log(10),
        ),
    ],
)
@pytest.mark.parametrize("shape", [(), (1,)])
def test_a_tensor_lr_is_filled_in_place(
    cls: type[WarmupScheduler],
    kw: dict[str, Any],
    first: float,
    after_one: float,
    shape: tuple[int, ...],
) -> None:
    lr = torch.full(shape, 0.1, dtype=torch.float64)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = cls(opt, **kw)
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(first)
    schedule.step(1)
    assert opt.param_groups[0]["lr"] is lr
    assert (lr.shape, lr.dtype) == (shape, torch.float64)
    assert lr.item() == pytest.approx(after_one)
    assert schedule.get_last_lr() == [pytest.approx(after_one)]  # numbers, as get_lr's


# --- build_scheduler --------------------------------------------------------------------------


def test_build_scheduler_from_config_section():
    opt = _sgd(1.0)
    params = {
        "total_num_steps": 30,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.1,
        "warmup_num_steps": 10,
        "warmup_type": "linear",
    }
    schedule = build_scheduler("WarmupDecayLR", opt, params)
    assert isinstance(schedule, WarmupDecayLR)
    assert _lrs_at(schedule, [20])[20] == [pytest.approx(0.05)]
    assert isinstance(build_scheduler("WarmupLR", _sgd(1.0), {}), WarmupLR)
    cosine = build_scheduler("WarmupCosineLR", _sgd(1.0), {"total_num_steps": 1000})
    assert isinstance(cosine, WarmupCosineLR)
    one_cycle = {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 10}
    assert isinstance(build_scheduler("OneCycle", _adam(), one_cycle), OneCycle)
    assert isinstance(build_scheduler("LRRangeTest", _sgd(1.0), {}), LRRangeTest)


def test_build_scheduler_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"'warmuplr'.*WarmupLR.*WarmupDecayLR.*WarmupCosineLR"):
        build_scheduler("warmuplr", _sgd(1.0), {})
    with pytest.raises(ValueError, match=r"\['max_lr'\].*warmup_max_lr"):
        build_scheduler("WarmupLR", _sgd(1.0), {"max_lr": 0.1})
    with pytest.raises(ValueError, match="total_num_steps"):
        build_scheduler("WarmupDecayLR", _sgd(1.0), {"warmup_num_steps": 10})
    with pytest.raises(ValueError, match="warmup_type"):
        build_scheduler("WarmupLR", _sgd(1.0), {"warmup_type": "Linear"})
