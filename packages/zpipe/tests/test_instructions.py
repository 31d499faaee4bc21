"""Instructions keep DeepSpeed's shape: kwargs, attributes, repr, dispatch by type."""

from collections.abc import Callable

import pytest

import zpipe
from zpipe import schedule


def test_buffer_op_kwargs_and_attributes():
    cmd = schedule.ForwardPass(3)
    assert cmd.kwargs == {"buffer_id": 3}
    assert cmd.buffer_id == 3
    assert cmd.name == "ForwardPass"
    assert repr(cmd) == "ForwardPass(buffer_id=3)"


def test_annotations_ride_outside_kwargs():
    cmd = schedule.BackwardPass(1, micro_batch_id=5, chunk_id=1)
    assert cmd.kwargs == {"buffer_id": 1}  # so `handler(**cmd.kwargs)` dispatch is unchanged
    assert (cmd.micro_batch_id, cmd.chunk_id) == (5, 1)


def test_extra_kwargs_become_attributes():
    cmd = schedule.SendActivation(0, tag="x")
    assert cmd.kwargs == {"buffer_id": 0, "tag": "x"}
    assert getattr(cmd, "tag") == "x"  # noqa: B009
    plain = schedule.OptimizerStep()
    assert plain.kwargs == {}
    assert repr(plain) == "OptimizerStep()"


def test_value_equality_and_hash():
    assert schedule.ForwardPass(0) == schedule.ForwardPass(0)
    assert schedule.ForwardPass(0) != schedule.ForwardPass(1)
    assert schedule.ForwardPass(0) != schedule.BackwardPass(0)
    assert schedule.ForwardPass(0, micro_batch_id=1) != schedule.ForwardPass(0, micro_batch_id=2)
    assert len({schedule.ReduceGrads(), schedule.ReduceGrads()}) == 1


def test_user_instruction_subclass_is_named_after_its_class():
    class Checkpoint(schedule.PipeInstruction):
        pass

    assert Checkpoint(every=2).name == "Checkpoint"
    assert repr(Checkpoint(every=2)) == "Checkpoint(every=2)"


def test_engine_style_dispatch():
    """What DeepSpeed's PipelineEngine does: a map from type to handler, called with kwargs."""
    seen: list[tuple[object, ...]] = []
    handlers: dict[type, Callable[..., None]] = {
        schedule.LoadMicroBatch: lambda buffer_id: seen.append(("load", buffer_id)),
        schedule.ForwardPass: lambda buffer_id: seen.append(("fwd", buffer_id)),
        schedule.BackwardPass: lambda buffer_id: seen.append(("bwd", buffer_id)),
        schedule.ReduceGrads: lambda: seen.append(("reduce",)),
        schedule.OptimizerStep: lambda: seen.append(("step",)),
    }
    for step in schedule.DataParallelSchedule(micro_batches=2, stages=1, stage_id=0):
        for cmd in step:
            handlers[type(cmd)](**cmd.kwargs)
    assert seen == [("load", 0), ("fwd", 0), ("bwd", 0)] * 2 + [("reduce",), ("step",)]


def test_same_classes_at_top_level_and_in_schedule_module():
    assert zpipe.TrainSchedule is schedule.TrainSchedule
    assert zpipe.BackwardWeightPass is schedule.BackwardWeightPass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"micro_batches": 0, "stages": 2, "stage_id": 0}, "micro_batches must be at least 1"),
        ({"micro_batches": 2, "stages": 0, "stage_id": 0}, "stages must be at least 1"),
        ({"micro_batches": 2, "stages": 2, "stage_id": 2}, "stage_id must be below stages=2"),
        ({"micro_batches": 2, "stages": 2, "stage_id": -1}, "stage_id must be at least 0"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        schedule.TrainSchedule(**kwargs)


def test_non_int_argument_is_a_type_error():
    with pytest.raises(TypeError, match="micro_batches must be an int"):
        schedule.TrainSchedule(micro_batches=2.0, stages=2, stage_id=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunks must be at least 1"):
        schedule.Interleaved1F1BSchedule(4, 2, 0, chunks=0)
