"""Schedules by name, for the command line and for engine configs."""

from __future__ import annotations

from zpipe._base import PipeSchedule
from zpipe._deepspeed import DataParallelSchedule, InferenceSchedule, TrainSchedule
from zpipe._gpipe import GPipeSchedule
from zpipe._interleaved import Interleaved1F1BSchedule
from zpipe._zero_bubble import ZeroBubbleH1Schedule

#: Short names of the built-in schedules.
SCHEDULES: dict[str, type[PipeSchedule]] = {
    "1f1b": TrainSchedule,
    "gpipe": GPipeSchedule,
    "interleaved": Interleaved1F1BSchedule,
    "zb-h1": ZeroBubbleH1Schedule,
    "inference": InferenceSchedule,
    "data-parallel": DataParallelSchedule,
}


def schedule_class(name: str) -> type[PipeSchedule]:
    """A built-in schedule by short name (`1f1b`, `zb-h1`, ...) or class name, any case."""
    wanted = name.lower().replace("_", "-")
    for key, cls in SCHEDULES.items():
        if wanted in (key, cls.__name__.lower()):
            return cls
    known = ", ".join([*SCHEDULES, *(cls.__name__ for cls in SCHEDULES.values())])
    raise ValueError(f"unknown schedule {name!r}; known: {known}")
