"""`ScheduleError`: what is wrong with a schedule, and where."""

from __future__ import annotations

from typing import Any


class ScheduleError(RuntimeError):
    """A schedule is unsafe or incomplete.

    `stage`, `step` and `instruction` say where (each None when it does not apply); the message
    says what, in words.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        step: int | None = None,
        instruction: Any = None,
    ) -> None:
        where = []
        if stage is not None:
            where.append(f"stage {stage}")
        if step is not None:
            where.append(f"step {step}")
        if instruction is not None:
            where.append(repr(instruction))
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.stage = stage
        self.step = step
        self.instruction = instruction
