"""`PipeSchedule`: the base class, with DeepSpeed's constructor, properties and iteration."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from zpipe._instructions import PipeInstruction

Step = list[PipeInstruction]


def check_positive(name: str, value: int, *, minimum: int = 1) -> None:
    """Raise a ValueError naming the argument when it is not an int of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


class PipeSchedule(ABC):
    """Directs the execution of a pipeline engine by generating sequences of instructions.

    A schedule is built for one stage: `steps()` yields that stage's steps, each a list of
    instructions run in order. Iterating the schedule yields the same steps, and can be repeated.

    A stage may hold several model chunks (`chunks`): chunk `c` of stage `s` is virtual stage
    `c * stages + s` of the model, unless a subclass maps them otherwise (`virtual_stage`).

    Args:
        micro_batches: the number of micro-batches in one batch.
        stages: the number of pipeline stages.
        stage_id: the stage this schedule is for, 0 to stages - 1.
    """

    #: model chunks per stage; subclasses that interleave set it per instance.
    chunks: int = 1

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__()
        check_positive("micro_batches", micro_batches)
        check_positive("stages", stages)
        check_positive("stage_id", stage_id, minimum=0)
        if stage_id >= stages:
            raise ValueError(f"stage_id must be below stages={stages}, got {stage_id}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = self.stage_id - 1
        self.next_stage = self.stage_id + 1
        self.it: Iterator[Step] | None = None

    @abstractmethod
    def steps(self) -> Iterator[Step]:
        """Yield this stage's steps, each a list of instructions."""

    def num_pipe_buffers(self) -> int:
        """The number of pipeline buffers this stage needs; buffer ids lie below it."""
        return self.micro_batches

    def virtual_stage(self, chunk_id: int) -> int:
        """The position in the whole model of this stage's chunk `chunk_id`."""
        return chunk_id * self.stages + self.stage_id

    def owner(self, virtual_stage: int) -> tuple[int, int]:
        """The (stage, chunk) that runs `virtual_stage`; the inverse of `virtual_stage`."""
        return virtual_stage % self.stages, virtual_stage // self.stages

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        assert self._valid_micro_batch(micro_batch_id)
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        """The stage this schedule is for."""
        return self.stage_id

    @property
    def num_stages(self) -> int:
        """The number of pipeline stages."""
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        """The number of micro-batches in one batch."""
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        """Whether this is the first stage."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this is the last stage."""
        return self.stage_id == self.stages - 1

    def __iter__(self) -> PipeSchedule:
        self.it = None
        return self

    def __next__(self) -> Step:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


def build_stages(
    schedule_cls: type[PipeSchedule], micro_batches: int, stages: int, **kwargs: Any
) -> list[PipeSchedule]:
    """The schedule of every stage, arguments checked first with errors that name them."""
    if not (isinstance(schedule_cls, type) and issubclass(schedule_cls, PipeSchedule)):
        raise TypeError(f"schedule_cls must be a PipeSchedule subclass, got {schedule_cls!r}")
    check_positive("micro_batches", micro_batches)
    check_positive("stages", stages)
    return [
        schedule_cls(micro_batches=micro_batches, stages=stages, stage_id=s, **kwargs)
        for s in range(stages)
    ]
