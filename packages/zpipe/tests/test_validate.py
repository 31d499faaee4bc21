"""validate(): every built-in schedule passes; every kind of broken schedule is caught."""

from collections.abc import Callable

import pytest

import zpipe
from zpipe import ScheduleError, schedule, validate

Steps = list[list[schedule.PipeInstruction]]


def mutated(base: type[schedule.PipeSchedule], stage: int, mutate: Callable[[Steps], None]):
    """`base`, with `mutate` applied to the steps of one stage."""

    class Mutated(base):  # type: ignore[valid-type, misc]
        def steps(self):
            steps = [list(step) for step in base.steps(self)]
            if self.stage_id == stage:
                mutate(steps)
            yield from steps

    return Mutated


def find(steps: Steps, cls: type) -> tuple[int, int]:
    for i, step in enumerate(steps):
        for j, cmd in enumerate(step):
            if type(cmd) is cls:
                return i, j
    raise AssertionError(f"no {cls.__name__}")


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("1f1b", {}),
        ("gpipe", {}),
        ("interleaved", {"chunks": 2}),
        ("interleaved", {"chunks": 3}),
        ("zb-h1", {}),
        ("inference", {}),
    ],
)
@pytest.mark.parametrize(("micro_batches", "stages"), [(1, 1), (1, 4), (3, 2), (8, 4), (13, 5)])
def test_built_in_schedules_validate(name, kwargs, micro_batches, stages):
    report = validate(zpipe.schedule_class(name), micro_batches, stages, **kwargs)
    assert len(report.steps) == stages
    assert all(p <= n for p, n in zip(report.peak_buffers, report.num_pipe_buffers, strict=True))


def test_report_counts_messages():
    report = validate(schedule.TrainSchedule, 4, 3)
    # each micro-batch crosses 2 stage boundaries forward and 2 backward
    assert sum(report.messages_sent) == 4 * 2 * 2
    assert report.messages_sent == [4, 8, 4]
    assert report.peak_buffers == [3, 2, 1]  # 1F1B: min(stages - stage, micro_batches)
    assert report.num_pipe_buffers == [3, 2, 2]  # DeepSpeed reserves at least 2


def test_swapped_send_and_receive_deadlock():
    def swap(steps: Steps) -> None:
        for step in steps:
            kinds = [type(c) for c in step]
            if schedule.SendGrad in kinds and schedule.RecvActivation in kinds:
                i, j = kinds.index(schedule.SendGrad), kinds.index(schedule.RecvActivation)
                step[i], step[j] = step[j], step[i]
                return
        raise AssertionError("no step with both")

    with pytest.raises(
        ScheduleError, match="stages 0 and 1 both receive from each other"
    ) as caught:
        validate(mutated(schedule.TrainSchedule, 1, swap), 4, 3)
    assert caught.value.stage == 0
    assert caught.value.step is not None
    assert isinstance(caught.value.instruction, schedule.PipeInstruction)


def test_dropped_receive_of_gradient():
    def drop(steps: Steps) -> None:
        i, j = find(steps, schedule.RecvGrad)
        del steps[i][j]

    # DeepSpeed's lock-step: without the receive, stage 1 sends on while stage 2 sends to it
    with pytest.raises(ScheduleError, match="stages 1 and 2 both send to each other") as caught:
        validate(mutated(schedule.TrainSchedule, 1, drop), 4, 3)
    assert caught.value.stage == 1
    assert isinstance(caught.value.instruction, schedule.SendActivation)


def test_dropped_receive_before_a_backward():
    def drop(steps: Steps) -> None:
        i, j = find(steps, schedule.RecvGrad)
        del steps[i][j]

    with pytest.raises(
        ScheduleError, match=r"stage 0, step \d+, BackwardPass.*: comes before the output gradient"
    ):
        validate(mutated(schedule.GPipeSchedule, 0, drop), 2, 2)


def test_send_without_matching_receive():
    def extra_send(steps: Steps) -> None:
        steps[-1].append(schedule.SendActivation(0))

    with pytest.raises(ScheduleError, match="no matching receive: stage 1 has finished"):
        validate(mutated(schedule.TrainSchedule, 0, extra_send), 2, 2)


def test_receive_of_the_wrong_kind():
    # On 2 interleaved stages, stage 0 sends stage 1 both activations and gradients over one
    # channel (NCCL matches in order, ignoring tags): a receive of the other kind is caught.
    def wrong_kind(steps: Steps) -> None:
        i, j = find(steps, schedule.RecvActivation)
        recv = steps[i][j]
        steps[i][j] = schedule.RecvGrad(recv.kwargs["buffer_id"], chunk_id=recv.chunk_id)

    with pytest.raises(
        ScheduleError,
        match=r"RecvGrad.*receives an activation \(micro-batch 0\) where it expects a gradient",
    ) as caught:
        validate(mutated(schedule.Interleaved1F1BSchedule, 1, wrong_kind), 4, 2, chunks=2)
    assert caught.value.stage == 1


def test_buffer_overwritten_while_needed():
    class OneBuffer(schedule.TrainSchedule):
        def num_pipe_buffers(self) -> int:
            return 1  # DeepSpeed's buffer ids are micro_batch % num_pipe_buffers()

    with pytest.raises(
        ScheduleError, match="overwrites buffer 0 with micro-batch 1 while it holds micro-batch 0"
    ):
        validate(OneBuffer, 4, 3)


def test_buffer_id_outside_num_pipe_buffers():
    class TooFew(schedule.GPipeSchedule):
        def num_pipe_buffers(self) -> int:
            return 1

    with pytest.raises(ScheduleError, match=r"buffer_id 1 is outside num_pipe_buffers\(\)=1"):
        validate(TooFew, 3, 2)


def test_backward_before_its_forward():
    def backward_first(steps: Steps) -> None:
        i, j = find(steps, schedule.BackwardPass)
        steps.insert(0, [steps[i].pop(j)])

    with pytest.raises(ScheduleError, match="comes before the forward") as caught:
        validate(mutated(schedule.GPipeSchedule, 1, backward_first), 2, 2)
    assert caught.value.stage == 1


def test_micro_batch_missing_its_backward():
    def skip(steps: Steps) -> None:
        del steps[-1][2]  # the BackwardPass of the last micro-batch
        del steps[-1][-2:]  # and the reduce and step that would notice first

    with pytest.raises(ScheduleError, match="micro-batch 1 on virtual stage 0 misses its backward"):
        validate(mutated(schedule.DataParallelSchedule, 0, skip), 2, 1)


def test_load_over_a_needed_buffer():
    def skip(steps: Steps) -> None:
        del steps[1][2]  # micro-batch 1 never runs backward, and buffer 0 is reused

    with pytest.raises(
        ScheduleError, match="overwrites buffer 0 with micro-batch 2 while it holds micro-batch 1"
    ):
        validate(mutated(schedule.DataParallelSchedule, 0, skip), 3, 1)


def test_micro_batch_missing_its_forward():
    class Short(schedule.InferenceSchedule):
        def steps(self):
            yield from list(super().steps())[:-1]

    with pytest.raises(ScheduleError, match="misses its forward"):
        validate(Short, 3, 1)


def test_optimizer_step_before_the_last_backward():
    def step_early(steps: Steps) -> None:
        steps[0] += steps[-1][-2:]
        del steps[-1][-2:]

    with pytest.raises(
        ScheduleError,
        match=r"ReduceGrads\(\): comes before the backward of micro-batch 1 on virtual stage 0",
    ):
        validate(mutated(schedule.DataParallelSchedule, 0, step_early), 2, 1)


def test_tied_reduction_skipped_by_one_stage():
    def skip_tied(steps: Steps) -> None:
        i, j = find(steps, schedule.ReduceTiedGrads)
        del steps[i][j]

    with pytest.raises(
        ScheduleError, match=r"collective that stages \[1\] finished without reaching"
    ):
        validate(mutated(schedule.TrainSchedule, 1, skip_tied), 2, 3)


def test_wrong_micro_batch_annotation():
    def relabel(steps: Steps) -> None:
        i, j = find(steps, schedule.ForwardPass)
        steps[i][j] = schedule.ForwardPass(steps[i][j].kwargs["buffer_id"], micro_batch_id=7)

    with pytest.raises(
        ScheduleError, match="annotated micro-batch 7 but its buffer holds micro-batch 0"
    ):
        validate(mutated(schedule.ZeroBubbleH1Schedule, 2, relabel), 4, 3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="stages must be at least 1"):
        validate(schedule.TrainSchedule, 4, 0)
    with pytest.raises(TypeError, match="schedule_cls must be a PipeSchedule subclass"):
        validate(schedule.ForwardPass, 4, 2)  # type: ignore[arg-type]
