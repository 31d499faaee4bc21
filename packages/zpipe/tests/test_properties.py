"""Properties over stages 1-16 and micro-batches 1-64: every built-in schedule is safe."""

from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe import SCHEDULES, schedule, simulate, validate

stages = st.integers(min_value=1, max_value=16)
micro_batches = st.integers(min_value=1, max_value=64)
chunks = st.integers(min_value=1, max_value=4)
pipelined = [cls for cls in SCHEDULES.values() if cls is not schedule.DataParallelSchedule]


@settings(max_examples=40, deadline=None)
@given(stages=stages, micro_batches=micro_batches, index=st.sampled_from(range(len(pipelined))))
def test_every_built_in_schedule_validates(stages, micro_batches, index):
    report = validate(pipelined[index], micro_batches, stages)
    assert all(p <= n for p, n in zip(report.peak_buffers, report.num_pipe_buffers, strict=True))


@settings(max_examples=40, deadline=None)
@given(stages=stages, micro_batches=micro_batches, chunks=chunks)
def test_interleaved_validates_for_any_count(stages, micro_batches, chunks):
    validate(schedule.Interleaved1F1BSchedule, micro_batches, stages, chunks=chunks)


@settings(max_examples=25, deadline=None)
@given(micro_batches=micro_batches)
def test_data_parallel_validates(micro_batches):
    validate(schedule.DataParallelSchedule, micro_batches, 1)


@settings(max_examples=30, deadline=None)
@given(stages=stages, micro_batches=micro_batches, chunks=chunks)
def test_interleaving_never_slower_than_one_f_one_b(stages, micro_batches, chunks):
    interleaved = simulate(schedule.Interleaved1F1BSchedule, micro_batches, stages, chunks=chunks)
    one_f_one_b = simulate(schedule.TrainSchedule, micro_batches, stages)
    assert interleaved.makespan <= one_f_one_b.makespan + 1e-9


@settings(max_examples=30, deadline=None)
@given(stages=stages, micro_batches=micro_batches)
def test_zero_bubble_memory_and_speed(stages, micro_batches):
    zb = simulate(schedule.ZeroBubbleH1Schedule, micro_batches, stages, backward=1, weight=1)
    one_f_one_b = simulate(schedule.TrainSchedule, micro_batches, stages, backward=1, weight=1)
    assert max(zb.peak_activations) <= stages
    assert zb.makespan <= one_f_one_b.makespan + 1e-9
