"""The new schedules: what they emit, per stage."""

import pytest

import zpipe
from zpipe import schedule

COMPUTE = (
    schedule.ForwardPass,
    schedule.BackwardPass,
    schedule.BackwardInputPass,
    schedule.BackwardWeightPass,
)


def computes(sched):
    return [cmd for step in sched for cmd in step if isinstance(cmd, COMPUTE)]


def test_gpipe_runs_every_forward_before_any_backward():
    sched = schedule.GPipeSchedule(micro_batches=4, stages=3, stage_id=1)
    kinds = [type(cmd).__name__[0] for cmd in computes(sched)]
    assert kinds == ["F"] * 4 + ["B"] * 4
    assert [cmd.micro_batch_id for cmd in computes(sched)] == [0, 1, 2, 3] * 2
    assert sched.num_pipe_buffers() >= 4


def test_interleaved_runs_every_chunk_of_every_micro_batch():
    sched = schedule.Interleaved1F1BSchedule(micro_batches=6, stages=3, stage_id=2, chunks=2)
    assert sched.chunks == 2
    assert [sched.virtual_stage(c) for c in range(2)] == [2, 5]
    forwards = {
        (c.micro_batch_id, c.chunk_id)
        for c in computes(sched)
        if isinstance(c, schedule.ForwardPass)
    }
    assert forwards == {(mb, chunk) for mb in range(6) for chunk in range(2)}


def test_interleaved_last_stage_wraps_activations_to_the_first():
    first = schedule.Interleaved1F1BSchedule(micro_batches=2, stages=2, stage_id=0, chunks=2)
    recvs = [c for step in first for c in step if isinstance(c, schedule.RecvActivation)]
    # chunk 1 of stage 0 is virtual stage 2, fed by virtual stage 1 on stage 1
    assert {c.chunk_id for c in recvs} == {1}
    assert first.owner(1) == (1, 0)


def test_zero_bubble_splits_every_backward():
    sched = schedule.ZeroBubbleH1Schedule(micro_batches=5, stages=3, stage_id=0)
    kinds = [type(c) for c in computes(sched)]
    assert schedule.BackwardPass not in kinds
    assert kinds.count(schedule.BackwardInputPass) == 5
    assert kinds.count(schedule.BackwardWeightPass) == 5


def test_zero_bubble_defers_weight_passes_on_later_stages():
    # stage i runs i rounds of (I, F) before its first W, per ZB-H1
    sched = schedule.ZeroBubbleH1Schedule(micro_batches=8, stages=4, stage_id=2)
    labels = [type(c).__name__[:9] for c in computes(sched)]
    first_w = labels.index("BackwardW")
    assert labels[:first_w].count("BackwardI") == 3


@pytest.mark.parametrize("cls", [schedule.GPipeSchedule, schedule.ZeroBubbleH1Schedule])
def test_last_step_reduces_and_steps(cls):
    sched = cls(micro_batches=3, stages=2, stage_id=1)
    last = list(sched)[-1]
    assert [type(c) for c in last[-3:]] == [
        schedule.ReduceTiedGrads,
        schedule.ReduceGrads,
        schedule.OptimizerStep,
    ]


@pytest.mark.parametrize("name", list(zpipe.SCHEDULES))
def test_every_buffer_id_is_below_num_pipe_buffers(name):
    cls = zpipe.schedule_class(name)
    stages = 1 if cls is schedule.DataParallelSchedule else 4
    for stage_id in range(stages):
        sched = cls(micro_batches=7, stages=stages, stage_id=stage_id)
        for step in sched:
            for cmd in step:
                if isinstance(cmd, schedule.BufferOpInstruction):
                    assert 0 <= cmd.buffer_id < sched.num_pipe_buffers()


def test_schedules_are_re_iterable():
    sched = schedule.Interleaved1F1BSchedule(micro_batches=4, stages=2, stage_id=1)
    assert list(sched) == list(sched)


def test_schedule_class_by_name():
    assert zpipe.schedule_class("ZB-H1") is schedule.ZeroBubbleH1Schedule
    assert zpipe.schedule_class("TrainSchedule") is schedule.TrainSchedule
    with pytest.raises(ValueError, match="unknown schedule 'nope'; known: 1f1b"):
        zpipe.schedule_class("nope")
