"""Pipeline-parallel schedules as pure Python: no torch, nothing but the standard library.

DeepSpeed's schedules and instructions (`zpipe.schedule` stands in for
`deepspeed.runtime.pipe.schedule`), more schedules (GPipe, interleaved 1F1B, ZB-H1), a
validator that proves a schedule safe under blocking point-to-point, and a simulator.
"""

from zpipe.__about__ import __version__
from zpipe._errors import ScheduleError
from zpipe._registry import SCHEDULES, schedule_class
from zpipe._simulate import Interval, Simulation, simulate
from zpipe._validate import ValidationReport, validate
from zpipe.schedule import (
    BackwardInputPass,
    BackwardPass,
    BackwardWeightPass,
    BufferOpInstruction,
    DataParallelSchedule,
    ForwardPass,
    GPipeSchedule,
    InferenceSchedule,
    Interleaved1F1BSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
    ZeroBubbleH1Schedule,
)

__all__ = [
    "SCHEDULES",
    "BackwardInputPass",
    "BackwardPass",
    "BackwardWeightPass",
    "BufferOpInstruction",
    "DataParallelSchedule",
    "ForwardPass",
    "GPipeSchedule",
    "InferenceSchedule",
    "Interleaved1F1BSchedule",
    "Interval",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "Simulation",
    "TrainSchedule",
    "ValidationReport",
    "ZeroBubbleH1Schedule",
    "__version__",
    "schedule_class",
    "simulate",
    "validate",
]
