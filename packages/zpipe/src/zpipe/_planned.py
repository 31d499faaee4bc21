"""`PlannedSchedule`: the base of schedules given as per-stage compute orders (see _plan)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator

from zpipe import _instructions
from zpipe._base import PipeSchedule, Step
from zpipe._plan import Op, Plan, cached_plan


class PlannedSchedule(PipeSchedule):
    """A training schedule whose steps come from a plan shared by all stages.

    Each step is one computation with the communication issued just before it; the last step
    also reduces the gradients (tied ones first) and steps the optimizer, as in TrainSchedule.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, *, chunks: int = 1) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.chunks = chunks

    @property
    def plan(self) -> Plan:
        """The plan of all stages (built once per shape and cached)."""
        return cached_plan(type(self).compute_orders, self.micro_batches, self.stages, self.chunks)

    @staticmethod
    @abstractmethod
    def compute_orders(micro_batches: int, stages: int, chunks: int) -> list[list[Op]]:
        """Every stage's computations, in order: (kind, micro-batch, chunk) with kind one of
        "F", "B", or the split "I" and "W". The plan adds communication and buffers."""

    def steps(self) -> Iterator[Step]:
        """Yield this stage's steps (the instructions are shared between iterations)."""
        planned = self.plan.steps[self.stage_id]
        for step in planned[:-1]:
            yield list(step)
        yield [
            *planned[-1],
            _instructions.ReduceTiedGrads(),
            _instructions.ReduceGrads(),
            _instructions.OptimizerStep(),
        ]

    def num_pipe_buffers(self) -> int:
        """The most buffers this stage holds at once (computed from the plan)."""
        return self.plan.buffers[self.stage_id]
