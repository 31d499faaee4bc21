"""Before a schedule first runs, the stages of a pipeline check that they run the same one.

Each stage all-gathers a line naming its schedule (class, micro-batches, stages, chunks) and a
digest of its own instructions. A stage whose line differs is named, with the first step where
its instructions differ from what this rank's schedule would have it do, so a config that
differs between ranks fails at once instead of deadlocking in the middle of a batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch.distributed as dist

import zcomm
import zpipe
from zengine._checkpoint import Sync  # its all-gather of any picklable value
from zengine.pipe._errors import PipelineError

__all__ = ["check_agreement"]


def _name(schedule: zpipe.PipeSchedule) -> str:
    return (
        f"{type(schedule).__name__}(micro_batches={schedule.micro_batches}, "
        f"stages={schedule.stages}, chunks={schedule.chunks})"
    )


def _steps(schedule: zpipe.PipeSchedule) -> list[list[str]]:
    return [[repr(cmd) for cmd in step] for step in schedule]


def _line(schedule: zpipe.PipeSchedule) -> str:
    digest = hashlib.sha1(repr(_steps(schedule)).encode()).hexdigest()[:16]
    return f"{_name(schedule)} {digest}"


def _first_difference(theirs: list[list[str]], ours: list[list[str]]) -> str:
    for step, (a, b) in enumerate(zip(theirs, ours, strict=False)):
        if a != b:
            return f"at step {step} it runs {a or ['nothing']} where this rank expects {b}"
    return f"it has {len(theirs)} steps where this rank expects {len(ours)}"


def check_agreement(
    schedule: zpipe.PipeSchedule,
    build: Callable[[type[zpipe.PipeSchedule], int], zpipe.PipeSchedule],
    *,
    group: dist.ProcessGroup,
) -> None:
    """Raise `PipelineError` on every stage when the stages' schedules differ. `build(cls,
    stage)` makes a stage's schedule as this rank configures it."""
    size = zcomm.get_world_size(group)
    if size == 1:
        return
    lines: list[str] = Sync(group, None).gather(_line(schedule))
    mine = schedule.stage_id
    for stage, line in enumerate(lines):
        ours = build(type(schedule), stage)
        if line == _line(ours):
            continue
        name = line.rsplit(" ", 1)[0]
        detail = "its instructions differ from this rank's build of them"
        try:
            theirs = build(zpipe.schedule_class(name.split("(")[0]), stage)
            detail = _first_difference(_steps(theirs), _steps(ours))
        except ValueError:
            pass  # not a built-in schedule: its steps cannot be rebuilt here
        raise PipelineError(
            f"the ranks disagree on the schedule: stage {stage} runs {name} but stage "
            f"{mine} runs {_name(schedule)}; on stage {stage}, {detail}",
            stage=stage,
        )
