"""`PlannedSchedule`: the base of schedules given as per-stage compute orders (see _plan)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from zpipe import _instructions
from zpipe._base import PipeSchedule, Step
from zpipe._plan import OrderFn, Plan, cached_plan

_CLASSES: dict[str, type[_instructions.BufferOpInstruction]] = {
    cls.__name__: cls
    for cls in vars(_instructions).values()
    if isinstance(cls, type) and issubclass(cls, _instructions.BufferOpInstruction)
}


class PlannedSchedule(PipeSchedule):
    """A training schedule whose steps come from a plan shared by all stages.

    Each step is one computation with the communication issued just before it; the last step
    also reduces the gradients (tied ones first) and steps the optimizer, as in TrainSchedule.
    """

    #: builds every stage's compute order from (micro_batches, stages, chunks)
    order_fn: ClassVar[OrderFn]

    def __init__(self, micro_batches: int, stages: int, stage_id: int, *, chunks: int = 1) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.chunks = chunks

    @property
    def plan(self) -> Plan:
        """The plan of all stages (built once per shape and cached)."""
        return cached_plan(type(self).order_fn, self.micro_batches, self.stages, self.chunks)

    def steps(self) -> Iterator[Step]:
        """Yield this stage's steps."""
        raw_steps = self.plan.steps[self.stage_id]
        for index, raw_step in enumerate(raw_steps):
            cmds: Step = [
                _CLASSES[name](buffer, micro_batch_id=mb, chunk_id=chunk)
                for name, buffer, mb, chunk in raw_step
            ]
            if index == len(raw_steps) - 1:
                cmds += [
                    _instructions.ReduceTiedGrads(),
                    _instructions.ReduceGrads(),
                    _instructions.OptimizerStep(),
                ]
            yield cmds

    def num_pipe_buffers(self) -> int:
        """The most buffers this stage holds at once (computed from the plan)."""
        return self.plan.buffers[self.stage_id]
