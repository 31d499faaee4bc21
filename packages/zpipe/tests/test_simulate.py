"""simulate(): the closed forms of each schedule with free communication, and the cost model."""

import pytest

from zpipe import schedule, simulate

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16, 32)]


@pytest.mark.parametrize(("stages", "micro_batches"), GRID)
@pytest.mark.parametrize("cls", [schedule.TrainSchedule, schedule.GPipeSchedule])
@pytest.mark.parametrize(("forward", "backward"), [(1.0, 2.0), (1.0, 1.0), (0.5, 3.0)])
def test_one_f_one_b_and_gpipe_bubble(cls, stages, micro_batches, forward, backward):
    p, m = stages, micro_batches
    result = simulate(cls, m, p, forward=forward, backward=backward)
    assert result.makespan == pytest.approx((m + p - 1) * (forward + backward), abs=1e-9)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)


@pytest.mark.parametrize(("stages", "micro_batches"), [(p, m) for p, m in GRID if m % p == 0])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_interleaved_bubble(stages, micro_batches, chunks):
    p, m, v = stages, micro_batches, chunks
    result = simulate(schedule.Interleaved1F1BSchedule, m, p, chunks=v)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)


@pytest.mark.parametrize(("stages", "micro_batches"), [(p, m) for p, m in GRID if m >= p])
def test_zero_bubble_h1_bubble(stages, micro_batches):
    p, m = stages, micro_batches
    result = simulate(schedule.ZeroBubbleH1Schedule, m, p, forward=1, backward=1, weight=1)
    assert result.makespan == pytest.approx(3 * m + p - 1)
    assert result.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-9)


def test_zero_bubble_beats_one_f_one_b_at_equal_work():
    one_f_one_b = simulate(schedule.TrainSchedule, 16, 4, forward=1, backward=2)
    zero_bubble = simulate(schedule.ZeroBubbleH1Schedule, 16, 4, forward=1, backward=1, weight=1)
    assert zero_bubble.makespan < one_f_one_b.makespan
    assert sum(zero_bubble.busy) == sum(one_f_one_b.busy)


def test_peak_activations():
    assert simulate(schedule.TrainSchedule, 8, 4).peak_activations == [4, 3, 2, 1]
    assert simulate(schedule.TrainSchedule, 2, 4).peak_activations == [2, 2, 2, 1]
    assert simulate(schedule.GPipeSchedule, 8, 4).peak_activations == [8, 8, 8, 8]
    assert simulate(schedule.ZeroBubbleH1Schedule, 8, 4).peak_activations == [4, 4, 4, 4]
    assert simulate(schedule.InferenceSchedule, 8, 4).peak_activations == [1, 1, 1, 1]


def test_interleaved_peak_is_megatrons():
    # stage r holds p + (p - 1 - 2r) / v micro-batches of its activations (Korthikanti et al.)
    p, v = 8, 2
    result = simulate(schedule.Interleaved1F1BSchedule, 32, p, chunks=v)
    assert result.peak_activations == [p + (p - 1 - 2 * r) / v for r in range(p)]


def test_communication_latency_lengthens_the_makespan():
    free = simulate(schedule.TrainSchedule, 8, 4)
    slow = simulate(schedule.TrainSchedule, 8, 4, comm=0.5)
    assert slow.makespan > free.makespan
    assert slow.busy == free.busy


def test_per_stage_costs():
    result = simulate(schedule.TrainSchedule, 8, 2, forward=[1, 2], backward=[2, 4])
    assert result.busy == [24, 48]
    # the slow stage sets the pace: the fast stage's first forward, the slow stage's 8
    # micro-batches back to back, then the fast stage's last backward: the lower bound
    assert result.makespan == pytest.approx(1 + 8 * 6 + 2)


def test_timeline_and_render():
    result = simulate(schedule.TrainSchedule, 2, 2)
    first = result.timeline[0]
    assert [(iv.kind, iv.micro_batch) for iv in first] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    text = result.render()
    lines = text.splitlines()
    assert lines[0].startswith("stage 0 |F0 F1 ")
    assert lines[1].startswith("stage 1 |...F0 B0")
    assert "idle" in lines[-1]
    narrow = result.render(width=10)
    assert all(len(line) == len("stage 0 |") + 10 + 1 for line in narrow.splitlines()[:2])


def test_render_names_chunks():
    text = simulate(schedule.Interleaved1F1BSchedule, 2, 2, chunks=2).render()
    assert "F0a" in text
    assert "B1b" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forward": [1, 2, 3]}, "forward has 3 costs, one per stage needs 2"),
        ({"backward": -1}, "backward must not be negative"),
        ({"comm": -0.1}, "comm must not be negative"),
    ],
)
def test_bad_costs_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate(schedule.TrainSchedule, 4, 2, **kwargs)
